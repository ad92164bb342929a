/* A stand-in for the CUDA driver library (libcuda.so.1) with the calls transfer/cuda.py makes and their real C
   signatures, over host memory: "allocations" are ranges registered by the test, a handle carries the base
   address. It checks the ctypes bindings (arguments by pointer and by value, the 64-byte handle struct passed by
   value, error names) on a machine without a GPU: tests/transfer/test_ipc.py compiles it. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char reserved[64]; } CUipcMemHandle;
static uint64_t reg_base[64];
static size_t reg_size[64];
static int nreg, opened, closed, refuse_unowned, owned, copies;
static uint64_t own_base[64];
static size_t own_size[64];

int fake_register(uint64_t base, size_t size) { reg_base[nreg] = base; reg_size[nreg] = size; return nreg++; }
int fake_opened(void) { return opened; }
int fake_closed(void) { return closed; }
int fake_owned(void) { return owned; }  /* cuMemAlloc'd blocks not yet freed */
int fake_copies(void) { return copies; }  /* cuMemcpyDtoDAsync_v2 calls */
/* refuse_unowned: cuIpcGetMemHandle refuses the registered ranges (an allocator's memory IPC cannot share), all:
   every range, the driver's own allocations too (a machine where IPC is off) */
void fake_refuse(int ranges, int all) { refuse_unowned = ranges ? (all ? 2 : 1) : 0; }

int cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal != 0) return 101; *dev = 7; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { if (dev != 7) return 101; *ctx = (void *)0x1234; return 0; }
int cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1234 ? 0 : 201; }
int cuGetErrorName(int rc, const char **name) {
    *name = rc == 1 ? "CUDA_ERROR_INVALID_VALUE" : rc == 101 ? "CUDA_ERROR_INVALID_DEVICE"
          : rc == 400 ? "CUDA_ERROR_INVALID_HANDLE" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuDeviceGetUuid_v2(unsigned char *uuid, int dev) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(i + dev);
    return 0;
}
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t ptr) {
    for (int i = 0; i < nreg; i++)
        if (ptr >= reg_base[i] && ptr < reg_base[i] + reg_size[i]) {
            *base = reg_base[i];
            *size = reg_size[i];
            return 0;
        }
    for (int i = 0; i < owned; i++)
        if (ptr >= own_base[i] && ptr < own_base[i] + own_size[i]) {
            *base = own_base[i];
            *size = own_size[i];
            return 0;
        }
    return 1;
}
int cuMemAlloc_v2(uint64_t *ptr, size_t size) {
    void *p = malloc(size);
    if (p == NULL) return 2;
    *ptr = (uint64_t)(uintptr_t)p;
    own_size[owned] = size;
    own_base[owned++] = *ptr;
    return 0;
}
int cuMemFree_v2(uint64_t ptr) {
    for (int i = 0; i < owned; i++)
        if (own_base[i] == ptr) {
            free((void *)(uintptr_t)ptr);
            --owned;
            own_base[i] = own_base[owned];
            own_size[i] = own_size[owned];
            return 0;
        }
    return 1;
}
int cuIpcGetMemHandle(CUipcMemHandle *h, uint64_t base) {
    int own = 0;
    for (int i = 0; i < owned; i++) own |= own_base[i] == base;
    if (refuse_unowned == 2 || (refuse_unowned == 1 && !own)) return 1;
    memset(h->reserved, 0, 64);
    memcpy(h->reserved, "fake", 4);
    memcpy(h->reserved + 56, &base, 8);
    return 0;
}
int cuIpcOpenMemHandle_v2(uint64_t *ptr, CUipcMemHandle h, unsigned flags) {
    if (memcmp(h.reserved, "fake", 4) != 0 || flags != 1) return 1;
    memcpy(ptr, h.reserved + 56, 8);
    opened++;
    return 0;
}
int cuIpcCloseMemHandle(uint64_t ptr) { closed++; return ptr ? 0 : 1; }
int cuStreamCreate(void **stream, unsigned flags) {
    if (flags != 1) return 1;  /* transfer/cuda.py asks for CU_STREAM_NON_BLOCKING */
    *stream = (void *)0x5678;
    return 0;
}
int cuStreamSynchronize(void *stream) { return stream == (void *)0x5678 ? 0 : 400; }
int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t n, void *stream) {
    if (stream != (void *)0x5678) return 400;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    copies++;
    return 0;
}

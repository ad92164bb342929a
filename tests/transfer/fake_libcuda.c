/* A stand-in for the CUDA driver library (libcuda.so.1) with the calls transfer/cuda.py makes and their real C
   signatures, over host memory: "allocations" are ranges registered by the test, a handle carries the base
   address. It checks the ctypes bindings (arguments by pointer and by value, the 64-byte handle struct passed by
   value, error names) on a machine without a GPU: tests/transfer/test_ipc.py compiles it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct { char reserved[64]; } CUipcMemHandle;
static uint64_t reg_base[64];
static size_t reg_size[64];
static int nreg, opened, closed;

int fake_register(uint64_t base, size_t size) { reg_base[nreg] = base; reg_size[nreg] = size; return nreg++; }
int fake_opened(void) { return opened; }
int fake_closed(void) { return closed; }

int cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal != 0) return 101; *dev = 7; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { if (dev != 7) return 101; *ctx = (void *)0x1234; return 0; }
int cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1234 ? 0 : 201; }
int cuGetErrorName(int rc, const char **name) {
    *name = rc == 1 ? "CUDA_ERROR_INVALID_VALUE" : rc == 101 ? "CUDA_ERROR_INVALID_DEVICE" : "CUDA_ERROR_UNKNOWN";
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
    return 1;
}
int cuIpcGetMemHandle(CUipcMemHandle *h, uint64_t base) {
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

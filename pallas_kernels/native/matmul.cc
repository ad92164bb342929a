// A decode step's matrix products for the CPU: a few rows against a layer's weights, called from XLA as FFI custom
// calls (pallas_kernels/native.py). XLA's CPU dot reads the weights at full memory bandwidth for one row, but two to
// eight rows run through a general matrix kernel tiled for many rows, slower than reading the weights once per row
// (SmolLM2-135M, 2 cores: 11 ms for one 212 MB stack of products at 2 rows against 7 ms at 1). These read each
// weight once, with every row's multiply-add on it in registers or L1:
//
//   x    [M, K]   float32, M <= kMaxRows
//   w    [K, N]   float32 (JaxserveMatmul: a linear layer's [in, out] weight)
//        [N, K]   float32 (JaxserveMatmulT: rows are output features, e.g. a tied embedding as the LM head)
//   out  [M, N]   float32
//
// JaxserveMatmul: work items are column panels of w (at most kPanel columns). A panel is swept in steps of kRows
// rows of w; each step's kRows row pieces meet every x row's kRows values (broadcast, held in registers) and add
// into the panel's accumulator [M, panel] in L1, so a weight is read once and each accumulator element is loaded
// and stored once per kRows multiply-adds.
// JaxserveMatmulT: work items are kRowsT output features; each is M dot products along contiguous K.
// JaxserveGroupedMatmul: an MoE layer's grouped products (rows sorted by expert, each group times its expert's
// weight of the layers' stack [L, E, K, N]), the weight read where it lies: a group's full chunks of kMaxRows rows
// in register blocks of kBlock columns (Block), its last rows through JaxserveMatmul's panels.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "run_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPanel = 512;  // columns per work item (JaxserveMatmul)
constexpr int64_t kRows = 8;     // rows of w per step (JaxserveMatmul)
constexpr int64_t kRowsT = 32;   // output features per work item (JaxserveMatmulT)
constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;   // columns of a register block (Block)

typedef float Vec __attribute__((vector_size(64), aligned(4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline float Sum(Vec v) {
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  Half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  Quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[:, n0:n0+C] = x @ w[:, n0:n0+C] for w [K, N].
template <int64_t M>
void Panel(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t K, int64_t N,
           int64_t n0, int64_t C) {
  alignas(64) float acc[M][kPanel];
  for (int64_t m = 0; m < M; ++m) std::memset(acc[m], 0, sizeof(float) * C);
  const int64_t Cv = C / kLanes * kLanes;
  int64_t k = 0;
  for (; k + kRows <= K; k += kRows) {
    Vec xb[M][kRows];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t t = 0; t < kRows; ++t) xb[m][t] = Vec{} + x[m * K + k + t];
    for (int64_t c = 0; c < Cv; c += kLanes) {
      Vec wv[kRows];
      for (int64_t t = 0; t < kRows; ++t) wv[t] = Load(w + (k + t) * N + n0 + c);
      for (int64_t m = 0; m < M; ++m) {
        Vec a = Load(&acc[m][c]);
        for (int64_t t = 0; t < kRows; ++t) a += xb[m][t] * wv[t];
        Store(&acc[m][c], a);
      }
    }
    for (int64_t c = Cv; c < C; ++c)
      for (int64_t t = 0; t < kRows; ++t)
        for (int64_t m = 0; m < M; ++m) acc[m][c] += x[m * K + k + t] * w[(k + t) * N + n0 + c];
  }
  for (; k < K; ++k)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c) acc[m][c] += x[m * K + k] * w[k * N + n0 + c];
  for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + n0, acc[m], sizeof(float) * C);
}

// out[:, n0:n1] = x @ w[n0:n1, :]^T for w [N, K].
template <int64_t M>
void Features(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const int64_t Kv = K / kLanes * kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    Vec acc[M];
    for (int64_t m = 0; m < M; ++m) acc[m] = Vec{};
    for (int64_t k = 0; k < Kv; k += kLanes) {
      const Vec wv = Load(row + k);
      for (int64_t m = 0; m < M; ++m) acc[m] += Load(x + m * K + k) * wv;
    }
    for (int64_t m = 0; m < M; ++m) {
      float s = Sum(acc[m]);
      for (int64_t k = Kv; k < K; ++k) s += x[m * K + k] * row[k];
      out[m * N + n] = s;
    }
  }
}

// f<M>(...) for the call's row count (1..kMaxRows).
template <template <int64_t> class F, typename... Args>
void ByRows(int64_t M, Args... args) {
  switch (M) {
    case 1: F<1>()(args...); break;
    case 2: F<2>()(args...); break;
    case 3: F<3>()(args...); break;
    case 4: F<4>()(args...); break;
    case 5: F<5>()(args...); break;
    case 6: F<6>()(args...); break;
    case 7: F<7>()(args...); break;
    default: F<8>()(args...); break;
  }
}

template <int64_t M>
struct PanelOf {
  void operator()(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t C) {
    Panel<M>(x, w, out, K, N, n0, C);
  }
};

template <int64_t M>
struct FeaturesOf {
  void operator()(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    Features<M>(x, w, out, K, N, n0, n1);
  }
};

ffi::Error Check(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, ffi::ResultBuffer<ffi::F32>& out, bool t,
                 int64_t* M, int64_t* K, int64_t* N) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("matmul: x [M, K], w [K, N] or [N, K], out [M, N]");
  }
  *M = xd[0], *K = xd[1], *N = t ? wd[0] : wd[1];
  if ((t ? wd[1] : wd[0]) != *K || od[0] != *M || od[1] != *N || *M < 1 || *M > kMaxRows) {
    return ffi::Error::InvalidArgument("matmul: shapes do not agree, or more than 8 rows");
  }
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  int64_t M, K, N;
  ffi::Error err = Check(x, w, out, false, &M, &K, &N);
  if (err.failure()) return err;
  // panels of at most kPanel columns, at least one per thread when the columns allow (multiples of kLanes)
  const int64_t workers = threads.num_threads() + 1;
  const int64_t share = ((N + workers - 1) / workers + kLanes - 1) / kLanes * kLanes;
  const int64_t C = std::max<int64_t>(kLanes, std::min(kPanel, share));
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* op = out->typed_data();
  jaxserve::RunItems(threads, (N + C - 1) / C, [=](int64_t i) {
    ByRows<PanelOf>(M, xp, wp, op, K, N, i * C, std::min(C, N - i * C));
  });
  return ffi::Error::Success();
}

ffi::Error MatmulTImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> out) {
  int64_t M, K, N;
  ffi::Error err = Check(x, w, out, true, &M, &K, &N);
  if (err.failure()) return err;
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* op = out->typed_data();
  jaxserve::RunItems(threads, (N + kRowsT - 1) / kRowsT, [=](int64_t i) {
    ByRows<FeaturesOf>(M, xp, wp, op, K, N, i * kRowsT, std::min(N, (i + 1) * kRowsT));
  });
  return ffi::Error::Success();
}

// out[:, n0:n0+kBlock] = x @ w[:, n0:n0+kBlock] for x of kMaxRows rows, w [K, N]: the accumulators (kMaxRows x
// kBlock) held in registers over the whole of K, each x value broadcast into its row's multiply-adds. For a
// prefill's full chunks of an expert's rows: Panel's accumulators go through L1 at every step of 8 weight rows,
// which bounds it by loads at about half the multiply-add rate.
void Block(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t K, int64_t N,
           int64_t n0) {
  Vec a[kMaxRows][kBlock / kLanes];
  for (int64_t m = 0; m < kMaxRows; ++m)
    for (int64_t b = 0; b < kBlock / kLanes; ++b) a[m][b] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[kBlock / kLanes];
    for (int64_t b = 0; b < kBlock / kLanes; ++b) wv[b] = Load(w + k * N + n0 + b * kLanes);
    for (int64_t m = 0; m < kMaxRows; ++m) {
      const float xv = x[m * K + k];
      for (int64_t b = 0; b < kBlock / kLanes; ++b) a[m][b] += xv * wv[b];
    }
  }
  for (int64_t m = 0; m < kMaxRows; ++m)
    for (int64_t b = 0; b < kBlock / kLanes; ++b) Store(out + m * N + n0 + b * kLanes, a[m][b]);
}

// JaxserveGroupedMatmul: x [M, K] rows sorted by group, w [L, E, K, N], sizes [E] int32 rows per group, layer []
// int32 -> out [M, N], each group's rows times w[layer, group] (rows past the groups: zeros). Work items are (group,
// column panel) pairs. A group's full chunks of kMaxRows rows run Block by Block, each block of the weight
// ([K, kBlock], in L2) meeting every chunk before the next is read; its last rows (a decode step's few) run Panel
// over the panel. The weight is read where it lies in the stack.
ffi::Error GroupedMatmulImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || sizes.element_count() != wd[1] || wd[2] != xd[1] ||
      od[0] != xd[0] || od[1] != wd[3]) {
    return ffi::Error::InvalidArgument("grouped matmul: x [M, K], w [L, E, K, N], sizes [E], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], E = wd[1], N = wd[3];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("grouped matmul: layer out of range");
  const int32_t* sz = sizes.typed_data();
  struct Group {
    int64_t row, rows, index;
  };
  std::vector<Group> groups;
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(sz[e], 0), M - r);
    if (n > 0) groups.push_back({r, n, e});
    r += n;
  }
  float* op = out->typed_data();
  std::memset(op + r * N, 0, sizeof(float) * (M - r) * N);
  if (groups.empty()) return ffi::Error::Success();
  // panels: at least one item per thread when the groups are fewer than the threads
  const int64_t workers = threads.num_threads() + 1;
  const int64_t per = std::max<int64_t>(1, (workers + groups.size() - 1) / groups.size());
  const int64_t share = ((N + per - 1) / per + kBlock - 1) / kBlock * kBlock;
  const int64_t C = std::max<int64_t>(kBlock, std::min(kPanel, share));
  const int64_t panels = (N + C - 1) / C;
  const float *xp = x.typed_data(), *wp = w.typed_data() + l * E * K * N;
  const Group* gp = groups.data();
  jaxserve::RunItems(threads, static_cast<int64_t>(groups.size()) * panels, [=](int64_t i) {
    const Group& g = gp[i / panels];
    const int64_t n0 = (i % panels) * C, n1 = std::min(C, N - n0) + n0;
    const float* wg = wp + g.index * K * N;
    const int64_t full = g.rows / kMaxRows * kMaxRows, blocked = n0 + (n1 - n0) / kBlock * kBlock;
    for (int64_t n = n0; n < blocked; n += kBlock)
      for (int64_t c = 0; c < full; c += kMaxRows) Block(xp + (g.row + c) * K, wg, op + (g.row + c) * N, K, N, n);
    for (int64_t c = 0; c < full && blocked < n1; c += kMaxRows)  // the panel's last columns
      ByRows<PanelOf>(kMaxRows, xp + (g.row + c) * K, wg, op + (g.row + c) * N, K, N, blocked, n1 - blocked);
    if (full < g.rows)
      ByRows<PanelOf>(g.rows - full, xp + (g.row + full) * K, wg, op + (g.row + full) * N, K, N, n0, n1 - n0);
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_MATMUL_BINDING                \
  ffi::Ffi::Bind()                             \
      .Ctx<ffi::ThreadPool>()                  \
      .Arg<ffi::Buffer<ffi::F32>>() /* x */    \
      .Arg<ffi::Buffer<ffi::F32>>() /* w */    \
      .Ret<ffi::Buffer<ffi::F32>>() /* out */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl, JAXSERVE_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulT, MatmulTImpl, JAXSERVE_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* x */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* w */
                                  .Arg<ffi::Buffer<ffi::S32>>() /* sizes */
                                  .Arg<ffi::Buffer<ffi::S32>>() /* layer */
                                  .Ret<ffi::Buffer<ffi::F32>>() /* out */);

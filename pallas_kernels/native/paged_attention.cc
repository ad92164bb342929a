// Paged decode attention for the CPU, called from XLA as an FFI custom call (pallas_kernels/native.py).
//
// The Pallas kernel (paged_attention.py) serves GPUs; on a CPU the jnp reference gathers every block the batch
// holds into a dense copy and multiplies thousands of [heads x head_dim] matrices by [head_dim x block] ones, a
// few microseconds each. This kernel reads the blocks where they lie in the pool, one pass, no copy:
//
//   q       [B, Hq, Dk]                     float32
//   pool    [NB, L, E, bs, Hkv, D]          float32, one full-attention cache group (jaxserve/cache/layout.py)
//   table   [B, W]                          int32 block ids per request
//   lengths [B]                             int32 tokens in the cache including the query's own (0: empty slot)
//   layer   []                              int32 index of the layer within the group (traced inside a scan)
//   sinks   [Hq]                            float32 (read only when has_sinks)
//   out     [B, Hq, v_hi - v_lo]            float32
//
// K of token t: pool[table[b, t / bs], layer, 0, t % bs, h, 0:k_dim]; V: pool[..., v_entry, ..., v_lo:v_hi].
// GQA (E = 2, or E = 1 with K|V concatenated on D) and MLA (E = 1, one latent "head", V the latent itself) are
// the same loop. The query sees tokens [max(0, n - window), n) with n = lengths[b] (window 0: all of them).
// Softmax in float32, online over blocks (a block's scores first, then one rescale of the accumulator).
//
// Work items are (request, KV head) pairs, taken from a shared counter by the calling thread and by helpers
// scheduled on XLA's intra-op thread pool; the call returns once every item is done.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Job {
  const float* q;
  const float* pool;
  const int32_t* table;
  const int32_t* lengths;
  const float* sinks;
  float* out;
  int64_t NB, L, E, bs, Hkv, D, W, Hq, Dk, Dv;
  int64_t layer, k_dim, v_entry, v_lo, window;
  float scale;
  bool has_sinks;
};

// One (request b, KV head h) pair: its G = Hq / Hkv query heads over the request's tokens.
void Attend(const Job& j, int64_t b, int64_t h) {
  const int64_t G = j.Hq / j.Hkv;
  float* out = j.out + (b * j.Hq + h * G) * j.Dv;
  const int64_t n = j.lengths[b];
  if (n <= 0) {
    std::fill(out, out + G * j.Dv, 0.0f);
    return;
  }
  const int64_t lo = j.window > 0 ? std::max<int64_t>(0, n - j.window) : 0;
  std::vector<float> q(G * j.k_dim), acc(G * j.Dv, 0.0f), m(G, -INFINITY), l(G, 0.0f), s(G * j.bs);
  for (int64_t g = 0; g < G; ++g) {
    const float* src = j.q + (b * j.Hq + h * G + g) * j.Dk;
    for (int64_t d = 0; d < j.k_dim; ++d) q[g * j.k_dim + d] = src[d] * j.scale;
  }
  const int64_t token_stride = j.Hkv * j.D;                // between tokens of a block
  const int64_t entry_stride = j.bs * token_stride;         // between K and V entries
  const int64_t block_stride = j.L * j.E * entry_stride;    // between blocks
  for (int64_t blk = lo / j.bs; blk * j.bs < n && blk < j.W; ++blk) {
    const int64_t t0 = std::max(lo, blk * j.bs), t1 = std::min(n, (blk + 1) * j.bs);
    const int64_t id = j.table[b * j.W + blk];
    if (id < 0 || id >= j.NB) continue;  // not a block of the pool (never in a valid table): nothing to read
    const float* base = j.pool + id * block_stride + j.layer * j.E * entry_stride + h * j.D;
    const float* kb = base;
    const float* vb = base + j.v_entry * entry_stride + j.v_lo;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q.data() + g * j.k_dim;
      float mx = m[g];
      for (int64_t t = t0; t < t1; ++t) {
        const float* k = kb + (t - blk * j.bs) * token_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < j.k_dim; ++d) dot += qg[d] * k[d];
        s[g * j.bs + (t - t0)] = dot;
        mx = std::max(mx, dot);
      }
      const float rescale = std::exp(m[g] - mx);  // 0 for the first block (m = -inf)
      float* a = acc.data() + g * j.Dv;
      for (int64_t d = 0; d < j.Dv; ++d) a[d] *= rescale;
      float sum = l[g] * rescale;
      for (int64_t t = t0; t < t1; ++t) {
        const float p = std::exp(s[g * j.bs + (t - t0)] - mx);
        sum += p;
        const float* v = vb + (t - blk * j.bs) * token_stride;
#pragma omp simd
        for (int64_t d = 0; d < j.Dv; ++d) a[d] += p * v[d];
      }
      m[g] = mx;
      l[g] = sum;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float den = l[g];
    float keep = 1.0f;
    if (j.has_sinks) {  // a sink joins the softmax as a logit with no value
      const float sink = j.sinks[h * G + g];
      const float mx = std::max(m[g], sink);
      keep = std::exp(m[g] - mx);
      den = l[g] * keep + std::exp(sink - mx);
    }
    const float inv = den > 0.0f ? keep / den : 0.0f;
    for (int64_t d = 0; d < j.Dv; ++d) out[g * j.Dv + d] = acc[g * j.Dv + d] * inv;
  }
}

struct Shared {
  Job job;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(Shared& sh) {
  for (int64_t i; (i = sh.next.fetch_add(1)) < sh.items;) {
    Attend(sh.job, i / sh.job.Hkv, i % sh.job.Hkv);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, int64_t k_dim,
                           int64_t v_entry, int64_t v_lo, int64_t v_hi, int64_t window, float scale,
                           bool has_sinks) {
  auto qd = q.dimensions(), pd = pool.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || pd.size() != 6 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged decode: q [B, Hq, Dk], pool [NB, L, E, bs, Hkv, D], table [B, W]");
  }
  auto shared = std::make_shared<Shared>();
  Job& j = shared->job;
  j = Job{q.typed_data(), pool.typed_data(), table.typed_data(), lengths.typed_data(), sinks.typed_data(),
          out->typed_data(), pd[0], pd[1], pd[2], pd[3], pd[4], pd[5], td[1], qd[1], qd[2], v_hi - v_lo,
          layer.typed_data()[0], k_dim, v_entry, v_lo, window, scale, has_sinks};
  if (j.Hq % j.Hkv || k_dim > j.D || v_hi > j.D || v_entry >= j.E || j.layer < 0 || j.layer >= j.L) {
    return ffi::Error::InvalidArgument("paged decode: heads, head dims, entry or layer outside the pool");
  }
  shared->items = qd[0] * j.Hkv;
  const int64_t helpers = std::min<int64_t>(pool_threads.num_threads(), shared->items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool_threads.Schedule([shared] { Drain(*shared); });
  }
  Drain(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<int64_t>("k_dim")
                                  .Attr<int64_t>("v_entry")
                                  .Attr<int64_t>("v_lo")
                                  .Attr<int64_t>("v_hi")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<bool>("has_sinks"));

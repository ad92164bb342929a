// Paged attention for the CPU, decode and prefill, called from XLA as FFI custom calls (pallas_kernels/native.py).
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
// Prefill (`JaxservePagedPrefill`) takes a packed step's tokens, each with its table row and position, after the
// step's own K/V are written into the pool:
//   q         [N, Hq, Dk]                   float32, the step's tokens packed (any rows, any order)
//   rows      [N]                           int32 table row of each token; outside [0, B): padding (zeros out)
//   positions [N]                           int32 position of each token: it sees tokens [lo, position]
//   out       [N, Hq, v_hi - v_lo]          float32
// Runs of up to kTile consecutive tokens of one row form a query tile: a tile's G * tokens query rows meet each
// key block once (the block transposed, then one fused multiply-add per key column), softmax online per row.
//
// Work items are (request, KV head) pairs (decode) or (query tile, KV head) pairs (prefill), taken from a
// shared counter by the calling thread and by helpers scheduled on XLA's intra-op thread pool; the call
// returns once every item is done.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "run_items.h"
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

// The factor that turns a query head's accumulator into its output: 1 / the softmax's denominator, with the
// head's sink (when the job has sinks) joining it as a logit with no value; 0 for a head that saw no key.
inline float OutputScale(const Job& j, int64_t head, float m, float l) {
  float den = l, keep = 1.0f;
  if (j.has_sinks) {
    const float sink = j.sinks[head];
    const float mx = std::max(m, sink);
    keep = std::exp(m - mx);
    den = l * keep + std::exp(sink - mx);
  }
  return den > 0.0f ? keep / den : 0.0f;
}

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
    const float inv = OutputScale(j, h * G + g, m[g], l[g]);
    for (int64_t d = 0; d < j.Dv; ++d) out[g * j.Dv + d] = acc[g * j.Dv + d] * inv;
  }
}

// A call's job from its buffers and attributes (per_query: decode's lengths; null for prefill), or why the shapes
// or attributes do not fit the pool.
ffi::Error MakeJob(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& pool, ffi::Buffer<ffi::S32>& table,
                   const int32_t* per_query, ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::F32>& sinks,
                   ffi::ResultBuffer<ffi::F32>& out, int64_t k_dim, int64_t v_entry, int64_t v_lo, int64_t v_hi,
                   int64_t window, float scale, bool has_sinks, Job* j) {
  auto qd = q.dimensions(), pd = pool.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || pd.size() != 6 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q [rows, Hq, Dk], pool [NB, L, E, bs, Hkv, D], table [B, W]");
  }
  *j = Job{q.typed_data(), pool.typed_data(), table.typed_data(), per_query, sinks.typed_data(),
           out->typed_data(), pd[0], pd[1], pd[2], pd[3], pd[4], pd[5], td[1], qd[1], qd[2], v_hi - v_lo,
           layer.typed_data()[0], k_dim, v_entry, v_lo, window, scale, has_sinks};
  if (j->Hq % j->Hkv || k_dim > j->D || v_hi > j->D || v_entry >= j->E || j->layer < 0 || j->layer >= j->L) {
    return ffi::Error::InvalidArgument("paged attention: heads, head dims, entry or layer outside the pool");
  }
  return ffi::Error::Success();
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, int64_t k_dim,
                           int64_t v_entry, int64_t v_lo, int64_t v_hi, int64_t window, float scale,
                           bool has_sinks) {
  Job j;
  ffi::Error err = MakeJob(q, pool, table, lengths.typed_data(), layer, sinks, out, k_dim, v_entry, v_lo, v_hi,
                           window, scale, has_sinks, &j);
  if (err.failure()) return err;
  jaxserve::RunItems(pool_threads, q.dimensions()[0] * j.Hkv, [j](int64_t i) { Attend(j, i / j.Hkv, i % j.Hkv); });
  return ffi::Error::Success();
}

// ---- prefill

constexpr int64_t kTile = 16;   // query tokens per tile
constexpr int64_t kMaxBs = 256;  // largest block size
constexpr int64_t kVec = 16;     // query rows per vector
constexpr int64_t kKeys = 4;     // keys scored together
constexpr int64_t kDims = 8;     // value dims accumulated together

// exp(x) for the softmax's x <= 0: 2^k (exponent bits) times e^f by its degree-6 Taylor polynomial, |f| <= ln2 / 2
// (relative error about 1e-7); branch-free, so that loops over it vectorize. Below -87 it gives about 1e-38.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float f = x - k * 0.69314718055994531f;
  float p = 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

struct Tile {
  int64_t first, count, row, pos0;  // tokens first..first+count-1 of row `row`, at positions pos0, pos0+1, ...
};

struct PrefillJob {
  Job base;  // lengths unused
  const int32_t* rows;
  const int32_t* positions;
};

// One (query tile, KV head h) pair. BS: the block size when it is a compile-time constant (0: j.bs).
// The tile's query rows (token r / G, head h * G + r % G) run along vectors: the queries, the scores and the
// accumulator are held transposed ([dim][row]), so that a key's or value's element is broadcast against kVec
// rows at once and kKeys keys (kDims value dims) accumulate in registers together; nothing is transposed per block.
template <int64_t BS>
void AttendTile(const PrefillJob& pj, const Tile& tile, int64_t h) {
  const Job& j = pj.base;
  const int64_t bs = BS > 0 ? BS : j.bs;
  const int64_t G = j.Hq / j.Hkv, nq = tile.count * G, nr = (nq + kVec - 1) / kVec * kVec;
  const int64_t kd = j.k_dim, Dv = j.Dv;
  std::vector<float> qt(kd * nr, 0.0f), at(Dv * nr, 0.0f), st(bs * nr), m(nr, -INFINITY), l(nr, 0.0f);
  std::vector<float> m_new(nr), rescale(nr), p_sum(nr);
  std::vector<int32_t> pos(nr, -1), first(nr, 0);  // row r sees positions [first[r], pos[r]]; padding rows none
  for (int64_t r = 0; r < nq; ++r) {
    pos[r] = static_cast<int32_t>(tile.pos0 + r / G);
    first[r] = j.window > 0 ? std::max<int32_t>(0, pos[r] + 1 - static_cast<int32_t>(j.window)) : 0;
    const float* src = j.q + ((tile.first + r / G) * j.Hq + h * G + r % G) * j.Dk;
    for (int64_t d = 0; d < kd; ++d) qt[d * nr + r] = src[d] * j.scale;
  }
  const int64_t token_stride = j.Hkv * j.D, entry_stride = j.bs * token_stride;
  const int64_t block_stride = j.L * j.E * entry_stride;
  const int64_t last = tile.pos0 + tile.count - 1;
  const int64_t lo = j.window > 0 ? std::max<int64_t>(0, tile.pos0 + 1 - j.window) : 0;
  for (int64_t blk = lo / bs; blk * bs <= last && blk < j.W; ++blk) {
    const int64_t id = j.table[tile.row * j.W + blk];
    if (id < 0 || id >= j.NB) continue;
    const int64_t base = blk * bs;
    const int64_t c_lo = std::max<int64_t>(lo - base, 0), c_hi = std::min<int64_t>(last + 1 - base, bs);
    const float* kb = j.pool + id * block_stride + j.layer * j.E * entry_stride + h * j.D;
    const float* vb = kb + j.v_entry * entry_stride + j.v_lo;
    // scores st[c][r] = q_r . k_c for the block's columns [c_lo, c_hi)
    for (int64_t c = c_lo; c < c_hi; c += kKeys) {
      const float* kr[kKeys];
      for (int64_t i = 0; i < kKeys; ++i) kr[i] = kb + std::min(c + i, c_hi - 1) * token_stride;
      for (int64_t rv = 0; rv < nr; rv += kVec) {
        float sacc[kKeys][kVec] = {};
        for (int64_t d = 0; d < kd; ++d) {
          const float* qv = qt.data() + d * nr + rv;
          for (int64_t i = 0; i < kKeys; ++i) {
            const float kv = kr[i][d];
#pragma omp simd
            for (int64_t x = 0; x < kVec; ++x) sacc[i][x] += qv[x] * kv;
          }
        }
        for (int64_t i = 0; i < kKeys && c + i < c_hi; ++i) {
          std::copy(sacc[i], sacc[i] + kVec, st.data() + (c + i) * nr + rv);
        }
      }
    }
    // online softmax over the block, per row: masked columns give 0
    std::copy(m.begin(), m.end(), m_new.begin());
    for (int64_t c = c_lo; c < c_hi; ++c) {
      const int32_t t = static_cast<int32_t>(base + c);
      const float* sc = st.data() + c * nr;
#pragma omp simd
      for (int64_t r = 0; r < nr; ++r) {
        if (t <= pos[r] && t >= first[r]) m_new[r] = std::max(m_new[r], sc[r]);
      }
    }
#pragma omp simd
    for (int64_t r = 0; r < nr; ++r) {
      rescale[r] = m[r] == -INFINITY ? 0.0f : ExpNonPositive(m[r] - m_new[r]);
      p_sum[r] = 0.0f;
    }
    for (int64_t c = c_lo; c < c_hi; ++c) {
      const int32_t t = static_cast<int32_t>(base + c);
      float* sc = st.data() + c * nr;
#pragma omp simd
      for (int64_t r = 0; r < nr; ++r) {
        const float p = (t <= pos[r] && t >= first[r]) ? ExpNonPositive(sc[r] - m_new[r]) : 0.0f;
        sc[r] = p;
        p_sum[r] += p;
      }
    }
#pragma omp simd
    for (int64_t r = 0; r < nr; ++r) {
      l[r] = l[r] * rescale[r] + p_sum[r];
      m[r] = m_new[r];
    }
    // accumulator at[d][r] = at[d][r] * rescale[r] + sum_c p[c][r] v_c[d]
    for (int64_t d0 = 0; d0 < Dv; d0 += kDims) {
      for (int64_t rv = 0; rv < nr; rv += kVec) {
        float pacc[kDims][kVec];
        for (int64_t i = 0; i < kDims; ++i) {
          const float* a = at.data() + std::min(d0 + i, Dv - 1) * nr + rv;
#pragma omp simd
          for (int64_t x = 0; x < kVec; ++x) pacc[i][x] = a[x] * rescale[rv + x];
        }
        for (int64_t c = c_lo; c < c_hi; ++c) {
          const float* pv = st.data() + c * nr + rv;
          const float* v = vb + c * token_stride;
          for (int64_t i = 0; i < kDims; ++i) {
            const float vd = v[std::min(d0 + i, Dv - 1)];
#pragma omp simd
            for (int64_t x = 0; x < kVec; ++x) pacc[i][x] += pv[x] * vd;
          }
        }
        for (int64_t i = 0; i < kDims && d0 + i < Dv; ++i) {
          std::copy(pacc[i], pacc[i] + kVec, at.data() + (d0 + i) * nr + rv);
        }
      }
    }
  }
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t head = h * G + r % G;
    const float inv = OutputScale(j, head, m[r], l[r]);
    float* o = j.out + ((tile.first + r / G) * j.Hq + head) * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = at[d * nr + r] * inv;
  }
}

// Query tiles of a packed step: runs of consecutive positions of one row, at most kTile tokens each; padding
// tokens' outputs are zeroed here.
std::vector<Tile> Tiles(const PrefillJob& pj, int64_t N, int64_t B) {
  const Job& j = pj.base;
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = pj.rows[i], pos = pj.positions[i];
    if (row < 0 || row >= B || pos < 0) {
      std::fill(j.out + i * j.Hq * j.Dv, j.out + (i + 1) * j.Hq * j.Dv, 0.0f);
      continue;
    }
    if (!tiles.empty()) {
      Tile& t = tiles.back();
      if (t.row == row && t.first + t.count == i && t.pos0 + t.count == pos && t.count < kTile) {
        ++t.count;
        continue;
      }
    }
    tiles.push_back(Tile{i, 1, row, pos});
  }
  return tiles;
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool,
                            ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                            int64_t k_dim, int64_t v_entry, int64_t v_lo, int64_t v_hi, int64_t window, float scale,
                            bool has_sinks) {
  PrefillJob pj{Job{}, rows.typed_data(), positions.typed_data()};
  ffi::Error err = MakeJob(q, pool, table, nullptr, layer, sinks, out, k_dim, v_entry, v_lo, v_hi, window, scale,
                           has_sinks, &pj.base);
  if (err.failure()) return err;
  const int64_t N = q.dimensions()[0];
  if (rows.element_count() != N || positions.element_count() != N || pj.base.bs > kMaxBs) {
    return ffi::Error::InvalidArgument("paged prefill: rows [N] and positions [N] for q [N, ...], block size <= 256");
  }
  auto tiles = std::make_shared<std::vector<Tile>>(Tiles(pj, N, table.dimensions()[0]));
  if (tiles->empty()) return ffi::Error::Success();
  const bool bs16 = pj.base.bs == 16;
  jaxserve::RunItems(pool_threads, static_cast<int64_t>(tiles->size()) * pj.base.Hkv, [pj, tiles, bs16](int64_t i) {
    const Tile& t = (*tiles)[i / pj.base.Hkv];
    if (bs16) {
      AttendTile<16>(pj, t, i % pj.base.Hkv);
    } else {
      AttendTile<0>(pj, t, i % pj.base.Hkv);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// Both handlers: the intra-op pool, q, pool and table, the per-query buffers (`PER_QUERY`), layer and sinks, out,
// then the same attributes.
#define JAXSERVE_PAGED_BINDING(PER_QUERY)                                                        \
  ffi::Ffi::Bind()                                                                               \
      .Ctx<ffi::ThreadPool>()                                                                    \
      .Arg<ffi::Buffer<ffi::F32>>() /* q */                                                      \
      .Arg<ffi::Buffer<ffi::F32>>() /* pool */                                                   \
      .Arg<ffi::Buffer<ffi::S32>>() /* table */ PER_QUERY                                        \
      .Arg<ffi::Buffer<ffi::S32>>() /* layer */                                                  \
      .Arg<ffi::Buffer<ffi::F32>>() /* sinks */                                                  \
      .Ret<ffi::Buffer<ffi::F32>>() /* out */                                                    \
      .Attr<int64_t>("k_dim")                                                                    \
      .Attr<int64_t>("v_entry")                                                                  \
      .Attr<int64_t>("v_lo")                                                                     \
      .Attr<int64_t>("v_hi")                                                                     \
      .Attr<int64_t>("window")                                                                   \
      .Attr<float>("scale")                                                                      \
      .Attr<bool>("has_sinks")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              JAXSERVE_PAGED_BINDING(.Arg<ffi::Buffer<ffi::S32>>() /* lengths */));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedPrefill, PagedPrefillImpl,
                              JAXSERVE_PAGED_BINDING(.Arg<ffi::Buffer<ffi::S32>>() /* rows */
                                                     .Arg<ffi::Buffer<ffi::S32>>() /* positions */));

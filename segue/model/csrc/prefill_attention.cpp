// Prefill attention over the paged KV cache for CPUs: a chunk of new query tokens attends to
// everything cached before it plus itself (causally), reading K/V blocks in place. One call
// serves every prefill chunk of a step (varlen). Tiled with an online softmax, so neither the
// context nor an [n x ctx] mask is ever materialised; GQA serves all query heads of a group from
// one read of each K/V row. Head sizes 64 and 128 (Llama-3, Qwen2.5), each compiled as its own
// constant; paged_prefill_supports tells callers which dtypes, head sizes and GQA groups it takes.
//
// Why not torch's SDPA: over cached context it needs the context gathered into a dense copy per
// layer and a dense mask, and its CPU flash kernel ran at a fifth of this CPU's GEMM rate
// (BENCHMARKS.md, "paged prefill attention").
//
// The arithmetic uses GCC vector extensions (16 fp32 lanes): one zmm register where the compiler
// targets AVX-512, two ymm on AVX2, scalar code elsewhere; the module is compiled on the machine
// that runs it (-march=native). Scores, softmax and the output accumulate in fp32 whatever the
// storage dtype. bf16 models on CPUs with AVX512-BF16 take prefill_bf16.h's tile instead.
#include <torch/extension.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t KB = 32;  // keys per tile: two 16-lane vectors of scores per query row
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads/stores

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }
inline v16 splat(float x) { return v16{} + x; }

#ifdef __AVX512F__
inline float hmax(v16 v) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v)); }
#else
inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
#endif

// exp over 16 lanes; -ffast-math lets the compiler call the vector exp of libmvec.
inline v16 vexp(v16 x) {
  alignas(64) float a[16];
  store(a, x);
#pragma omp simd
  for (int i = 0; i < 16; ++i) a[i] = std::exp(a[i]);
  return load(a);
}

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// One work item: tokens [t0, t1) of one sequence's chunk, one KV head, all `group` query heads.
struct Tile {
  const int64_t* table;  // the sequence's block table
  int64_t start_pos;     // position of the chunk's first token
  int64_t row0;          // the chunk's first row in q / out
  int64_t t0, t1;        // token range of this tile within the chunk
  int64_t kv_head;
};

// Thread-local scratch, reused across tiles; D is the head size.
template <int64_t D>
struct Scratch {
  std::vector<float> q, o, m, l, p;  // per row: queries, output, running max and sum, probabilities
  alignas(64) float kt[D * KB];      // K tile transposed: [dim][key], so scores vectorize over keys
  alignas(64) float vt[KB * D];      // V tile as fp32 rows: [key][dim]
};

#ifdef __AVX512F__
inline float hsum(v16 v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
#else
inline float hsum(v16 v) {
  float t = 0.f;
  for (int i = 0; i < 16; ++i) t += v[i];
  return t;
}
#endif

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// One row's online-softmax step over a tile of KB scores: keys past `last` (the row's own
// position) or past `nk` (the context) are masked; the running max m and sum l are updated, the
// output row o rescaled, and the tile's probabilities written to p (zeros where masked).
template <int64_t D>
inline void softmax_update(v16 sc[2], int64_t last, int64_t nk, float& m, float& l, float* o, float* p) {
  if (last < KB - 1 || nk < KB)
    for (int64_t j = 0; j < KB; ++j)
      if (j > last || j >= nk) sc[j / 16][j % 16] = NEG_INF;
  const float mx = std::max(hmax(sc[0]), hmax(sc[1]));
  if (mx == NEG_INF) {  // no visible key for this row in this tile
    std::fill(p, p + KB, 0.f);
    return;
  }
  const float m_new = std::max(m, mx);
  const float alpha = std::exp(m - m_new);  // 0 on the row's first tile
  const v16 p0 = vexp(sc[0] - m_new), p1 = vexp(sc[1] - m_new);
  store(p, p0);
  store(p + 16, p1);
  l = l * alpha + hsum(p0 + p1);
  m = m_new;
  if (alpha != 1.f)
    for (int64_t d = 0; d < D; d += 16) store(o + d, load(o + d) * alpha);
}

// Scores of four query rows against the tile's KB keys: eight independent FMA chains, each
// K vector loaded once for four rows.
template <int64_t D>
inline void scores4(const float* q, const float* kt, v16 out[4][2]) {
  v16 a[4][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const v16 k0 = load(kt + d * KB), k1 = load(kt + d * KB + 16);
    for (int i = 0; i < 4; ++i) {
      const float qd = q[i * D + d];
      a[i][0] += qd * k0;
      a[i][1] += qd * k1;
    }
  }
  std::memcpy(out, a, sizeof(a));
}

// O[row] += P[row] . V for two rows: eight output vectors, each V row loaded once for both.
// Wider heads take 64 dims per pass, so the accumulators still fit the registers.
template <int64_t D>
inline void accumulate2(const float* p0, const float* p1, const float* vt, float* o0, float* o1) {
  static_assert(D % 64 == 0, "the output is accumulated 64 dims at a time");
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    v16 a[2][4];
    for (int c = 0; c < 4; ++c) {
      a[0][c] = load(o0 + c0 + 16 * c);
      a[1][c] = load(o1 + c0 + 16 * c);
    }
    for (int64_t j = 0; j < KB; ++j) {
      const float* v = vt + j * D + c0;
      const float x0 = p0[j], x1 = p1[j];
      for (int c = 0; c < 4; ++c) {
        const v16 vv = load(v + 16 * c);
        a[0][c] += x0 * vv;
        a[1][c] += x1 * vv;
      }
    }
    for (int c = 0; c < 4; ++c) {
      store(o0 + c0 + 16 * c, a[0][c]);
      store(o1 + c0 + 16 * c, a[1][c]);
    }
  }
}

template <int64_t D, typename C>
inline void pack_tile(const C* kc, const C* vc, const int64_t* table, int64_t head_base, int64_t block_size,
                      int64_t k0, int64_t nk, float* kt, float* vt) {
  for (int64_t j = 0; j < KB; ++j) {
    if (j < nk) {
      const int64_t pos = k0 + j;
      const int64_t off = head_base + (table[pos / block_size] * block_size + pos % block_size) * D;
      for (int64_t d = 0; d < D; ++d) {
        kt[d * KB + j] = to_f(kc[off + d]);
        vt[j * D + d] = to_f(vc[off + d]);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        kt[d * KB + j] = 0.f;
        vt[j * D + d] = 0.f;
      }
    }
  }
}

template <int64_t D, typename T, typename C>
void attend_tile(const Tile& tile, const T* q, int64_t q_row_stride, const C* kc, const C* vc, T* out,
                 int64_t heads, int64_t group, int64_t num_blocks, int64_t block_size, float scale,
                 Scratch<D>& s) {
  const int64_t ntok = tile.t1 - tile.t0, rows = ntok * group;
  const int64_t padded = (rows + 3) / 4 * 4;  // whole blocks of four rows; pad rows stay zero
  s.q.assign(padded * D, 0.f);
  s.o.assign(padded * D, 0.f);
  s.m.assign(padded, NEG_INF);
  s.l.assign(padded, 0.f);
  s.p.resize(padded * KB);
  // Row r = token (r / group), head (kv_head * group + r % group); queries pre-scaled.
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (tile.row0 + tile.t0 + r / group) * q_row_stride + (tile.kv_head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = to_f(qr[d]) * scale;
  }
  const int64_t first_pos = tile.start_pos + tile.t0;  // position of the tile's first query
  const int64_t ctx_end = tile.start_pos + tile.t1;      // keys [0, ctx_end) are visible to some row
  const int64_t head_base = tile.kv_head * num_blocks * block_size * D;
  for (int64_t k0 = 0; k0 < ctx_end; k0 += KB) {
    const int64_t nk = std::min(KB, ctx_end - k0);
    pack_tile<D>(kc, vc, tile.table, head_base, block_size, k0, nk, s.kt, s.vt);
    // Keys past a row's own position (or past the context) are masked: only the last tiles.
    const bool needs_mask = k0 + KB - 1 > first_pos;
    for (int64_t r = 0; r < padded; r += 4) {
      v16 sc[4][2];
      scores4<D>(s.q.data() + r * D, s.kt, sc);
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t row = r + i;
        float* p = s.p.data() + row * KB;
        if (row >= rows) {
          std::fill(p, p + KB, 0.f);
          continue;
        }
        const int64_t last = needs_mask ? first_pos + row / group - k0 : KB;  // last visible key
        softmax_update<D>(sc[i], last, nk, s.m[row], s.l[row], s.o.data() + row * D, p);
      }
      for (int64_t i = 0; i < 4; i += 2)
        accumulate2<D>(s.p.data() + (r + i) * KB, s.p.data() + (r + i + 1) * KB, s.vt,
                       s.o.data() + (r + i) * D, s.o.data() + (r + i + 1) * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* orow = out + ((tile.row0 + tile.t0 + r / group) * heads + tile.kv_head * group + r % group) * D;
    const float inv = 1.f / s.l[r];  // every row sees at least its own key
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(s.o[r * D + d] * inv);
  }
}

}  // namespace

#include "prefill_bf16.h"

namespace {

template <int64_t D, typename T, typename C>
void prefill_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const std::vector<Tile>& tiles, float scale, torch::Tensor& out) {
  const int64_t heads = q.size(1);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(tiles.size());
#ifdef SEGUE_PREFILL_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
#pragma omp parallel if (n > 1)
    {
      bf16dp::Scratch<D> scratch;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i)
        bf16dp::attend_tile<D>(tiles[i], qp, q.stride(0), kp, vp, op, heads, group, num_blocks, block_size, scale, scratch);
    }
    return;
  }
#endif
#pragma omp parallel if (n > 1)
  {
    Scratch<D> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i)
      attend_tile<D, T, C>(tiles[i], qp, q.stride(0), kp, vp, op, heads, group, num_blocks, block_size, scale, scratch);
  }
}

template <int64_t D>
void prefill_dispatch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const std::vector<Tile>& tiles, float scale, torch::Tensor& out) {
  if (q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16) {
    prefill_impl<D, float, c10::BFloat16>(q, k_cache, v_cache, tiles, scale, out);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_impl<D, scalar_t, scalar_t>(q, k_cache, v_cache, tiles, scale, out);
  });
}

// What the kernel takes, in one place: paged_prefill_attention checks its arguments against these
// and paged_prefill_supports answers from them, so the two cannot disagree.
bool head_dim_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

bool dtypes_supported(at::ScalarType q, at::ScalarType cache) {
  if (q == at::kFloat && cache == at::kBFloat16) return true;
  return q == cache && (q == at::kFloat || q == at::kDouble || q == at::kBFloat16 || q == at::kHalf);
}

// Query rows per tile. A KV head's whole group shares each tile (one read of each K/V row for
// all its query heads), so a group larger than this cannot run at all.
int64_t tile_rows(at::ScalarType q, at::ScalarType cache) {
#ifdef SEGUE_PREFILL_BF16
  if (q == at::kBFloat16 && cache == at::kBFloat16) return bf16dp::ROWS;
#endif
  return 64;  // ~64 rows (tokens x group heads): enough to amortise loading each K/V tile
}

}  // namespace

bool paged_prefill_supports(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim, int64_t group) {
  return head_dim_supported(head_dim) && dtypes_supported(q_dtype, cache_dtype) && group >= 1 &&
         group <= tile_rows(q_dtype, cache_dtype);
}

torch::Tensor paged_prefill_attention(torch::Tensor q,             // [T, heads, dim]: every chunk's rows
                                      torch::Tensor k_cache,       // [kv_heads, blocks, block_size, dim]
                                      torch::Tensor v_cache,
                                      torch::Tensor query_start,   // [n + 1] int64: chunk i is rows [qs[i], qs[i+1])
                                      torch::Tensor start_pos,     // [n] int64: position of each chunk's first token
                                      torch::Tensor block_tables,  // [n, max_blocks] int64
                                      double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention: q must be [T, heads, dim] and the caches [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && head_dim_supported(q.size(2)),
              "paged_prefill_attention: head size 64 or 128 only, the same in q and the cache (q has ", q.size(2),
              ", the cache ", k_cache.size(3), ")");
  TORCH_CHECK(k_cache.size(0) >= 1 && q.size(1) >= 1 && q.size(1) % k_cache.size(0) == 0,
              "paged_prefill_attention: query heads not a positive multiple of KV heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_prefill_attention: K and V caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_prefill_attention: KV cache must be contiguous");
  TORCH_CHECK(dtypes_supported(q.scalar_type(), k_cache.scalar_type()),
              "paged_prefill_attention: the cache must have q's dtype (or bf16 under fp32), one of fp32, fp64, "
              "bf16, fp16 (q is ", q.scalar_type(), ", the cache ", k_cache.scalar_type(), ")");
  // q is usually a view into the fused QKV projection: rows strided, heads and dims dense.
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  query_start = query_start.to(torch::kInt64).contiguous();
  start_pos = start_pos.to(torch::kInt64).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  const int64_t n = start_pos.size(0), max_blocks = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(1), block_size = k_cache.size(2), kv_heads = k_cache.size(0);
  const int64_t group = q.size(1) / kv_heads;
  TORCH_CHECK(query_start.size(0) == n + 1 && block_tables.size(0) == n,
              "paged_prefill_attention: query_start must have n + 1 entries and block_tables n rows");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[n] == q.size(0), "paged_prefill_attention: query_start must span q's rows");
  // A wrong call must raise, not read outside the cache: every block a chunk reads is checked.
  const int64_t rows = tile_rows(q.scalar_type(), k_cache.scalar_type());
  TORCH_CHECK(group <= rows, "paged_prefill_attention: more than ", rows, " query heads per KV head");
  const int64_t tile_tokens = rows / group;
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = qs[i + 1] - qs[i];
    TORCH_CHECK(len >= 1 && sp[i] >= 0, "paged_prefill_attention: chunk ", i, " is empty or starts before 0");
    const int64_t ctx = sp[i] + len;
    const int64_t blocks = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= max_blocks, "paged_prefill_attention: chunk ", i, " needs ", blocks,
                " blocks, its table has ", max_blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t id = bt[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_prefill_attention: block id ", id, " outside the cache");
    }
    for (int64_t t0 = 0; t0 < len; t0 += tile_tokens)
      for (int64_t h = 0; h < kv_heads; ++h)
        tiles.push_back(Tile{bt + i * max_blocks, sp[i], qs[i], t0, std::min(len, t0 + tile_tokens), h});
  }
  // Longest tiles (most context) first, so the dynamic schedule ends with the short ones.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.start_pos + a.t1 > b.start_pos + b.t1; });
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  // The head size is a compile-time constant: fixed trip counts, accumulators in registers.
  if (q.size(2) == 64)
    prefill_dispatch<64>(q, k_cache, v_cache, tiles, static_cast<float>(scale), out);
  else
    prefill_dispatch<128>(q, k_cache, v_cache, tiles, static_cast<float>(scale), out);
  return out;
}

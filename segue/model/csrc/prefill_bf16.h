// The prefill tile for bf16 models on CPUs with AVX512-BF16: both matmuls of attention (Q.K^T and
// P.V) run as bf16 pair dot products with fp32 accumulation (vdpbf16ps: 32 multiply-adds per
// instruction, twice fp32's rate), the way oneDNN's bf16 GEMMs run the linear layers. Scores,
// softmax and the output stay fp32; P is rounded to bf16 for the P.V product, as flash attention
// does on GPUs. Included by prefill_attention.cpp (after Tile and KB).
//
// Vector lanes are query rows (16 per register, ROWS per tile), not keys: each K and V element
// is broadcast from the cache row in place, so K is never transposed, and the online softmax is
// vertical (max, sum and rescale per lane) with no horizontal reductions. The first version
// (lanes = keys) spent more time packing K and reducing rows than multiplying.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SEGUE_PREFILL_BF16 1
#include <immintrin.h>

#include <climits>
#include <cstdint>

namespace bf16dp {

constexpr int64_t ROWS = 48;  // query rows per tile: three registers of 16 lanes (16 tokens of a GQA-3 group)
// Masked scores: finite, so nothing depends on infinities under -ffast-math; exp() of it is 0.
constexpr float MASKED = -1e30f;
constexpr int64_t RV = ROWS / 16;
static_assert(KB == 32, "the key tile is 32 keys: 16 pairs for P.V");

// D is the head size. The register blocking does not depend on it (accumulators span rows and
// 8 keys or 8 dims; D is only a trip count), so 128-wide heads keep ROWS, and with it the GQA
// group limit, and double the query, output and V scratch: ~53 KB a thread against ~31 KB. The
// output (24 KB at 128) is read and written once per key tile, 8 dims at a time.
template <int64_t D>
struct Scratch {
  static_assert(D % 16 == 0, "V is interleaved 16 dims at a time");
  alignas(64) uint32_t qt[D / 2][ROWS];   // [dim pair][row]: the tile's queries, pairs of bf16
  alignas(64) float ot[D][ROWS];          // [dim][row]: the output accumulator
  alignas(64) float st[KB][ROWS];         // [key][row]: scores, then probabilities
  alignas(64) uint32_t pp[KB / 2][ROWS];  // [key pair][row]: probabilities as bf16 pairs
  alignas(64) uint32_t vp[KB / 2][D];     // [key pair][dim]: V of keys 2t and 2t+1 interleaved
};

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// e^x for x <= 0 (scores minus their running max): Cephes' range reduction and degree-5
// polynomial in registers, relative error ~2e-7; below -87.3 it returns ~1e-38, i.e. nothing
// next to the row's maximum term of 1. (A call into libmvec per 16 values cost a third of the tile.)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

template <int64_t D>
inline void attend_tile(const Tile& tile, const c10::BFloat16* q, int64_t q_row_stride, const c10::BFloat16* kc,
                        const c10::BFloat16* vc, c10::BFloat16* out, int64_t heads, int64_t group,
                        int64_t num_blocks, int64_t block_size, float scale, Scratch<D>& s) {
  const int64_t rows = (tile.t1 - tile.t0) * group;  // <= ROWS, by the tiling
  // Each lane's query position; padding lanes copy the last row's (their results are dropped).
  alignas(64) int32_t qpos[ROWS];
  for (int64_t r = 0; r < ROWS; ++r)
    qpos[r] = static_cast<int32_t>(tile.start_pos + tile.t0 + std::min(r, rows - 1) / group);
  std::memset(s.qt, 0, sizeof(s.qt));
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(
        q + (tile.row0 + tile.t0 + r / group) * q_row_stride + (tile.kv_head * group + r % group) * D);
    for (int64_t p = 0; p < D / 2; ++p) s.qt[p][r] = qr[p];
  }
  std::memset(s.ot, 0, sizeof(s.ot));
  __m512 m[RV], l[RV];
  __m512i qp[RV];
  for (int v = 0; v < RV; ++v) {
    m[v] = _mm512_set1_ps(MASKED);
    l[v] = _mm512_setzero_ps();
    qp[v] = _mm512_load_si512(qpos + 16 * v);
  }
  const auto* kc32 = reinterpret_cast<const uint32_t*>(kc);
  const auto* vc16 = reinterpret_cast<const uint16_t*>(vc);
  const int64_t first_pos = tile.start_pos + tile.t0, ctx_end = tile.start_pos + tile.t1;
  const int64_t head_base = tile.kv_head * num_blocks * block_size * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  // Lane r of a key-pair register holds (p[2t][r], p[2t+1][r]): interleave the two bf16 halves.
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t k0 = 0; k0 < ctx_end; k0 += KB) {
    const int64_t nk = std::min(KB, ctx_end - k0);
    const uint32_t* krow[KB];
    const uint16_t* vrow[KB];
    for (int64_t j = 0; j < KB; ++j) {
      const int64_t pos = k0 + std::min(j, nk - 1);  // keys past the context: a valid row, masked below
      const int64_t off = head_base + (tile.table[pos / block_size] * block_size + pos % block_size) * D;
      krow[j] = kc32 + off / 2;
      vrow[j] = vc16 + off;
    }
    // S^T[j] = Q . K[j] for all rows at once, eight keys at a time (16 independent chains).
    for (int64_t j0 = 0; j0 < KB; j0 += 8) {
      __m512 acc[RV][8];
      for (int v = 0; v < RV; ++v)
        for (int jj = 0; jj < 8; ++jj) acc[v][jj] = _mm512_setzero_ps();
      for (int64_t p = 0; p < D / 2; ++p) {
        __m512i qv[RV];
        for (int v = 0; v < RV; ++v) qv[v] = _mm512_load_si512(s.qt[p] + 16 * v);
        for (int jj = 0; jj < 8; ++jj) {
          const __m512i kb = _mm512_set1_epi32(static_cast<int>(krow[j0 + jj][p]));
          for (int v = 0; v < RV; ++v) acc[v][jj] = dot(acc[v][jj], qv[v], kb);
        }
      }
      for (int jj = 0; jj < 8; ++jj)
        for (int v = 0; v < RV; ++v) _mm512_store_ps(s.st[j0 + jj] + 16 * v, _mm512_mul_ps(acc[v][jj], vscale));
    }
    // Online softmax, one lane per row: keys past a row's position or past the context masked.
    const bool needs_mask = k0 + KB - 1 > first_pos || nk < KB;
    __m512 alpha[RV];
    for (int v = 0; v < RV; ++v) {
      __m512 mx = m[v];
      for (int64_t j = 0; j < KB; ++j) {
        __m512 sc = _mm512_load_ps(s.st[j] + 16 * v);
        if (needs_mask) {
          const __mmask16 hidden = j >= nk ? __mmask16(0xFFFF)
                                           : _mm512_cmplt_epi32_mask(qp[v], _mm512_set1_epi32(static_cast<int>(k0 + j)));
          sc = _mm512_mask_blend_ps(hidden, sc, _mm512_set1_ps(MASKED));
          _mm512_store_ps(s.st[j] + 16 * v, sc);
        }
        mx = _mm512_max_ps(mx, sc);
      }
      // Every row sees key 0 in the first tile, so mx is finite from then on.
      alpha[v] = exp16(_mm512_sub_ps(m[v], mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < KB; ++j) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s.st[j] + 16 * v), mx));
        _mm512_store_ps(s.st[j] + 16 * v, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum);
      m[v] = mx;
      for (int64_t t = 0; t < KB / 2; ++t) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_load_ps(s.st[2 * t + 1] + 16 * v),
                                                  _mm512_load_ps(s.st[2 * t] + 16 * v));
        _mm512_store_si512(s.pp[t] + 16 * v, _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(pair)));
      }
    }
    // V of each key pair, interleaved per dim; keys past the context are zeros (not garbage
    // that a zero probability would turn into NaN).
    for (int64_t t = 0; t < KB / 2; ++t) {
      for (int64_t c = 0; c < D / 16; ++c) {
        __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * t] + 16 * c)));
        __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * t + 1] + 16 * c)));
        if (2 * t >= nk) lo = _mm512_setzero_si512();
        if (2 * t + 1 >= nk) hi = _mm512_setzero_si512();
        _mm512_store_si512(s.vp[t] + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    // O^T[d] = alpha * O^T[d] + sum_t P[t] . V[t][d], eight dims at a time (16 chains).
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m512 acc[RV][8];
      for (int dd = 0; dd < 8; ++dd)
        for (int v = 0; v < RV; ++v) acc[v][dd] = _mm512_mul_ps(_mm512_load_ps(s.ot[d0 + dd] + 16 * v), alpha[v]);
      for (int64_t t = 0; t < KB / 2; ++t) {
        __m512i pv[RV];
        for (int v = 0; v < RV; ++v) pv[v] = _mm512_load_si512(s.pp[t] + 16 * v);
        for (int dd = 0; dd < 8; ++dd) {
          const __m512i vb = _mm512_set1_epi32(static_cast<int>(s.vp[t][d0 + dd]));
          for (int v = 0; v < RV; ++v) acc[v][dd] = dot(acc[v][dd], pv[v], vb);
        }
      }
      for (int dd = 0; dd < 8; ++dd)
        for (int v = 0; v < RV; ++v) _mm512_store_ps(s.ot[d0 + dd] + 16 * v, acc[v][dd]);
    }
  }
  alignas(64) float inv[ROWS];
  for (int v = 0; v < RV; ++v) _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), l[v]));
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* orow = out + ((tile.row0 + tile.t0 + r / group) * heads + tile.kv_head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<c10::BFloat16>(s.ot[d][r] * inv[r]);
  }
}

}  // namespace bf16dp
#endif

// The prefill tile for bf16 models on CPUs with AVX512-BF16: both matmuls of attention (Q.K^T and
// P.V) run as bf16 pair dot products with fp32 accumulation (vdpbf16ps: 32 multiply-adds per
// instruction, twice fp32's rate), the way oneDNN's bf16 GEMMs run the linear layers. Scores,
// softmax and the output stay fp32; P is rounded to bf16 for the P.V product, as flash attention
// does on GPUs. Included by prefill_attention.cpp (after Tile, softmax_update and KB).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SEGUE_PREFILL_BF16 1
#include <immintrin.h>

#include <cstdint>

namespace bf16dp {

static_assert(KB == 32, "the packing below is written for 32-key tiles");

// A pair of bf16 values is handled as one 32-bit lane.
struct Scratch {
  std::vector<uint32_t> q;           // [rows][32]: each query row as 32 dim pairs
  std::vector<float> o, m, l;        // [rows][64] output, running max and sum
  alignas(64) uint32_t kp[2][32][16];  // per 16-key half: [dim pair][key]
  alignas(64) uint32_t vp[16][64];     // [key pair][dim]: V of keys 2t and 2t+1 interleaved
  alignas(64) uint32_t pp[4][16];      // per row of a 4-row block: probabilities as key pairs
  alignas(64) float p[4][KB];
};

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

inline void pack(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t head_base,
                 int64_t block_size, int64_t k0, int64_t nk, Scratch& s) {
  const uint16_t* krow[KB];
  const uint16_t* vrow[KB];
  for (int64_t j = 0; j < KB; ++j) {
    const int64_t pos = k0 + std::min(j, nk - 1);  // rows past the context: any valid row, masked later
    const int64_t off = head_base + (table[pos / block_size] * block_size + pos % block_size) * 64;
    krow[j] = kc + off;
    vrow[j] = vc + off;
  }
  for (int64_t j = 0; j < KB; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(krow[j]);
    for (int64_t p = 0; p < 32; ++p) s.kp[j / 16][p][j % 16] = k[p];
  }
  for (int64_t t = 0; t < KB / 2; ++t) {
    // Rows past the context must not be NaN-carrying garbage under a zero probability.
    const bool hi_valid = 2 * t + 1 < nk, lo_valid = 2 * t < nk;
    for (int64_t c = 0; c < 4; ++c) {
      __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * t] + 16 * c)));
      __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * t + 1] + 16 * c)));
      if (!lo_valid) lo = _mm512_setzero_si512();
      if (!hi_valid) hi = _mm512_setzero_si512();
      _mm512_store_si512(s.vp[t] + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

inline void attend_tile(const Tile& tile, const c10::BFloat16* q, int64_t q_row_stride, const c10::BFloat16* kc,
                        const c10::BFloat16* vc, c10::BFloat16* out, int64_t heads, int64_t group,
                        int64_t num_blocks, int64_t block_size, float scale, Scratch& s) {
  constexpr int64_t D = 64;
  const int64_t rows = (tile.t1 - tile.t0) * group;
  const int64_t padded = (rows + 3) / 4 * 4;
  s.q.assign(padded * 32, 0u);
  s.o.assign(padded * D, 0.f);
  s.m.assign(padded, NEG_INF);
  s.l.assign(padded, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* qr = q + (tile.row0 + tile.t0 + r / group) * q_row_stride + (tile.kv_head * group + r % group) * D;
    std::memcpy(s.q.data() + r * 32, qr, D * sizeof(uint16_t));
  }
  const auto* kc16 = reinterpret_cast<const uint16_t*>(kc);
  const auto* vc16 = reinterpret_cast<const uint16_t*>(vc);
  const int64_t first_pos = tile.start_pos + tile.t0;
  const int64_t ctx_end = tile.start_pos + tile.t1;
  const int64_t head_base = tile.kv_head * num_blocks * block_size * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t k0 = 0; k0 < ctx_end; k0 += KB) {
    const int64_t nk = std::min(KB, ctx_end - k0);
    pack(kc16, vc16, tile.table, head_base, block_size, k0, nk, s);
    const bool needs_mask = k0 + KB - 1 > first_pos;
    for (int64_t r = 0; r < padded; r += 4) {
      __m512 acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      const uint32_t* qb = s.q.data() + r * 32;
      for (int64_t p = 0; p < 32; ++p) {
        const __m512i k0v = _mm512_load_si512(s.kp[0][p]), k1v = _mm512_load_si512(s.kp[1][p]);
        for (int i = 0; i < 4; ++i) {
          const __m512i qv = _mm512_set1_epi32(static_cast<int>(qb[i * 32 + p]));
          acc[i][0] = dot(acc[i][0], qv, k0v);
          acc[i][1] = dot(acc[i][1], qv, k1v);
        }
      }
      for (int i = 0; i < 4; ++i) {
        const int64_t row = r + i;
        if (row >= rows) {
          std::fill(s.p[i], s.p[i] + KB, 0.f);
        } else {
          v16 sc[2] = {reinterpret_cast<v16>(_mm512_mul_ps(acc[i][0], vscale)),
                       reinterpret_cast<v16>(_mm512_mul_ps(acc[i][1], vscale))};
          const int64_t last = needs_mask ? first_pos + row / group - k0 : KB;
          softmax_update(sc, last, nk, s.m[row], s.l[row], s.o.data() + row * D, s.p[i]);
        }
        // (p0..p15 from the low half, p16..p31 from the high): pair t = keys 2t, 2t+1.
        const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_load_ps(s.p[i] + 16), _mm512_load_ps(s.p[i]));
        _mm512_store_si512(s.pp[i], reinterpret_cast<__m512i>(pb));
      }
      __m512 o[4][4];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) o[i][c] = _mm512_loadu_ps(s.o.data() + (r + i) * D + 16 * c);
      for (int64_t t = 0; t < KB / 2; ++t) {
        __m512i v[4];
        for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512(s.vp[t] + 16 * c);
        for (int i = 0; i < 4; ++i) {
          const __m512i pv = _mm512_set1_epi32(static_cast<int>(s.pp[i][t]));
          for (int c = 0; c < 4; ++c) o[i][c] = dot(o[i][c], pv, v[c]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s.o.data() + (r + i) * D + 16 * c, o[i][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* orow = out + ((tile.row0 + tile.t0 + r / group) * heads + tile.kv_head * group + r % group) * D;
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<c10::BFloat16>(s.o[r * D + d] * inv);
  }
}

}  // namespace bf16dp
#endif

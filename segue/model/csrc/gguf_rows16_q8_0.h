// Q8_0 as rows16 (see gguf_rows16.h): 16 output rows interleaved, one register lane a row.
//
// A tile is one 32-block of 16 rows, exactly the file's 16 * 34 bytes: d[16] fp16, then
// qs[8][16][4]: positions 4c..4c+3 of row i as unsigned bytes q + 128, laid so that nibble_words'
// word registers hold the low nibbles of positions (0,1), (2,3) and the high nibbles of (0,1),
// (2,3). A signed code is q = 16 hi + lo - 128 with both nibbles exact in the bf16 mantissa
// (v = 1 + nibble / 16), so x . q = 256 x . v_hi + 16 x . v_lo - 400 sum(x): twice the products of
// a 4-bit format over twice its bytes.
#pragma once
#ifdef SEGUE_GGUF_BF16

namespace gguf_rows16 {

struct Q8 {
  static constexpr int64_t SUBS = 1, QS = 32, TILE = QS + 512, FILE_BYTES = 34;
  // Byte k of a row's 4 bytes holds position ORDER[k]: even bytes feed word registers 0 and 2
  // (positions 0, 1), odd bytes 1 and 3 (positions 2, 3).
  static constexpr int ORDER[4] = {0, 2, 1, 3};

  static void pack_tile(const uint8_t* const* rows, uint8_t* tile) {
    for (int i = 0; i < ROWS; ++i) {
      std::memcpy(tile + 2 * i, rows[i], 2);
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 4; ++k) tile[QS + 64 * c + 4 * i + k] = static_cast<uint8_t>(rows[i][2 + 4 * c + ORDER[k]] ^ 0x80);
    }
  }

  template <int R>
  static void dot(const uint8_t* tiles, int64_t K, const uint16_t* x, const float* xsum, float (*out)[ROWS]) {
    using gguf_dot::PREFETCH;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __mmask32 none[4] = {};
    const __m512 sixteen = _mm512_set1_ps(16.f), offset = _mm512_set1_ps(400.f);
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* t = tiles + b * TILE;
      for (int l = 0; l < TILE; l += 64) _mm_prefetch(reinterpret_cast<const char*>(t + PREFETCH + l), _MM_HINT_T0);
      const __m512 d = halves(t), d16 = _mm512_mul_ps(sixteen, d), m = _mm512_mul_ps(offset, d);
      __m512 lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
      for (int c = 0; c < 8; ++c) {
        __m512i w[4];
        gguf_dot::nibble_words<false>(_mm512_loadu_si512(t + QS + 64 * c), w, none);
        for (int r = 0; r < R; ++r) {
          int32_t pair[2];  // the activation pairs of positions (0,1), (2,3)
          std::memcpy(pair, x + r * K + 32 * b + 4 * c, 8);
          const __m512bh x01 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[0]));
          const __m512bh x23 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[1]));
          lo[r] = _mm512_dpbf16_ps(lo[r], x01, reinterpret_cast<__m512bh>(w[0]));
          hi[r] = _mm512_dpbf16_ps(hi[r], x01, reinterpret_cast<__m512bh>(w[2]));
          lo[r] = _mm512_dpbf16_ps(lo[r], x23, reinterpret_cast<__m512bh>(w[1]));
          hi[r] = _mm512_dpbf16_ps(hi[r], x23, reinterpret_cast<__m512bh>(w[3]));
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi[r], sixteen, lo[r]), d16, acc[r]);
        acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xsum[r * (K / 32) + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
  }

  // Row i of a group as bf16: w = d q rounded once (gguf_bf16's Dequant alike).
  static void dequantize_row(const uint8_t* tiles, int64_t K, int i, c10::BFloat16* out) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* t = tiles + b * TILE;
      const float d = f16(t + 2 * i);
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 4; ++k) {
          const int q = static_cast<int>(t[QS + 64 * c + 4 * i + k]) - 128;
          out[32 * b + 4 * c + ORDER[k]] = c10::BFloat16(d * static_cast<float>(q));
        }
    }
  }

  // All 16 rows: each position of 16 rows widened, scaled and paired, then stored a row at a time.
  static void dequantize_group(const uint8_t* tiles, int64_t K, c10::BFloat16* out) {
    const __m512i low = _mm512_set1_epi32(0xFF), bias = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* t = tiles + b * TILE;
      const __m512 d = halves(t);
      __m512i pairs[16];  // [2c + h]: positions 4c + 2h, 4c + 2h + 1 of rows 0..15
      for (int c = 0; c < 8; ++c) {
        const __m512i raw = _mm512_loadu_si512(t + QS + 64 * c);
        __m512 v[4];  // byte k: position ORDER[k]
        for (int k = 0; k < 4; ++k)
          v[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(raw, 8 * k), low), bias)));
        pairs[2 * c] = pair_bf16(v[0], v[2]);
        pairs[2 * c + 1] = pair_bf16(v[1], v[3]);
      }
      store_rows(pairs, out + 32 * b, K);
    }
  }
};

}  // namespace gguf_rows16
#endif

// Q4_K, Q4_0 and Q4_1 with 16 output rows interleaved ("rows16"), for bf16 activations on CPUs
// with AVX512-BF16 (included by gguf_ops.cpp after gguf_dot.h).
//
// The file's layout keeps a row's blocks together, so a kernel reading it sums 16 lanes of one row
// and must spread each sub-block's scale over the lanes its codes landed in, then reduce the
// lanes: about as many instructions go to scales, permutes and reductions as to the products.
// Here one register lane is one output row: 16 rows' codes for the same 8 positions share a
// register, the activation pair of a position is broadcast from memory into the product
// (vdpbf16ps with a dword broadcast, natural activation order, nothing prepared), and a
// sub-block's scales and mins for the 16 rows are one vector each. What is left per 32 weights a
// row is the code decoding (nibble_words: two ops a register) and the products. (Q6_K laid out
// alike ran slower than its file-layout kernel on a Zen 4: assembling 6-bit codes word by word
// costs what the lane reductions saved, and that kernel is near the memory bound there.)
//
// A group's tiles follow one another over K; every sub-block (32 positions) of a tile holds
//   qs[4][16][4]   positions 8c..8c+7 of row i: 4 bytes of 8 codes, laid so that nibble_words'
//                  word registers 0..3 hold positions (0,1), (2,3), (4,5), (6,7) (pack_nibbles)
// after the tile's scales, which are each format's own (below).
#pragma once
#ifdef SEGUE_GGUF_BF16

namespace gguf_rows16 {

constexpr int ROWS = 16;
constexpr int64_t QS_BYTES = 256;  // one sub-block's codes of 16 rows

// Positions (within 8) of the low and high nibble of byte k of a row's 4 bytes (see nibble_words:
// word registers 0..3 read the low nibbles of even bytes, of odd bytes, the high nibbles of even,
// of odd bytes, and dword lane i pairs bytes 0-1 with 2-3). Word register k then holds positions
// 2k and 2k + 1, its nibbles at bit SHIFT[k] of each 16-bit word.
constexpr int LOW[4] = {0, 2, 1, 3}, HIGH[4] = {4, 6, 5, 7}, SHIFT[4] = {0, 8, 4, 12};

// The 4 bytes of a row's 8 nibbles, code(p) for positions p = 0..7.
template <typename Code>
inline void pack_nibbles(Code code, uint8_t* out) {
  for (int k = 0; k < 4; ++k) out[k] = static_cast<uint8_t>((code(LOW[k]) & 15) | (code(HIGH[k]) & 15) << 4);
}

inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Q4_K: a tile is one super-block (8 sub-blocks), the file's bytes plus 3 %:
//   d[16], dmin[16] fp16; sc[8][16], m[8][16] the unpacked 6-bit scales and mins; qs[8].
// w = s q + mf with s = d sc, mf = -(dmin m).
struct Q4K {
  static constexpr int64_t SUBS = 8, TILE = 64 + 256 + SUBS * QS_BYTES, SC = 64, MIN = 192, QS = 320, OFFSET = 0;
  static constexpr int64_t FILE_BYTES = 144;

  static int code(const uint8_t* b, int e) {  // position e of a file block: 64-position chunks, low nibbles first
    const uint8_t byte = b[16 + 32 * (e / 64) + e % 32];
    return (e % 64) < 32 ? byte & 15 : byte >> 4;
  }
  static void pack_tile(const uint8_t* const* rows, uint8_t* tile) {
    for (int i = 0; i < ROWS; ++i) {
      const uint8_t* b = rows[i];
      std::memcpy(tile + 2 * i, b, 2);
      std::memcpy(tile + 32 + 2 * i, b + 2, 2);
      alignas(16) uint8_t sm[16];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sm), gguf_bf16::scales_mins(b + 4));
      for (int j = 0; j < SUBS; ++j) {
        tile[SC + 16 * j + i] = sm[j];
        tile[MIN + 16 * j + i] = sm[8 + j];
        for (int c = 0; c < 4; ++c)
          pack_nibbles([&](int p) { return code(b, 32 * j + 8 * c + p); }, tile + QS + QS_BYTES * j + 64 * c + 4 * i);
      }
    }
  }
  static void scales(const uint8_t* t, int j, __m512& s, __m512& mf) {
    s = _mm512_mul_ps(halves(t), bytes(t + SC + 16 * j));
    mf = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(halves(t + 32), bytes(t + MIN + 16 * j)));
  }
};

// Q4_0 / Q4_1: a tile is one 32-block, exactly the file's bytes: d[16] (and m[16]) fp16, qs.
// w = d (q - 8) for Q4_0, d q + m for Q4_1.
template <bool WITH_MIN>
struct Legacy {
  static constexpr int64_t SUBS = 1, QS = WITH_MIN ? 64 : 32, TILE = QS + QS_BYTES, OFFSET = WITH_MIN ? 0 : 8;
  static constexpr int64_t FILE_BYTES = WITH_MIN ? 20 : 18;

  static void pack_tile(const uint8_t* const* rows, uint8_t* tile) {
    for (int i = 0; i < ROWS; ++i) {
      const uint8_t* b = rows[i];
      std::memcpy(tile + 2 * i, b, 2);
      if (WITH_MIN) std::memcpy(tile + 32 + 2 * i, b + 2, 2);
      const uint8_t* qs = b + (WITH_MIN ? 4 : 2);  // position e: qs[e] low nibble, qs[e - 16] high
      for (int c = 0; c < 4; ++c)
        pack_nibbles([&](int p) { const int e = 8 * c + p; return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; },
                     tile + QS + 64 * c + 4 * i);
    }
  }
  static void scales(const uint8_t* t, int, __m512& s, __m512& mf) {
    s = halves(t);
    mf = WITH_MIN ? halves(t + 32) : _mm512_setzero_ps();
  }
};

// out[r][0..16) = the group's rows' dot with x row r, for R rows of x (bf16 bits, natural order,
// stride K) and xsum, their sums over 32-wide runs (stride K / 32).
template <typename F, int R>
inline void dot(const uint8_t* tiles, int64_t K, const uint16_t* x, const float* xsum, float (*out)[ROWS]) {
  using gguf_dot::PREFETCH;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __mmask32 none[4] = {};
  const __m512 sixteen = _mm512_set1_ps(16.f), shifted = _mm512_set1_ps(static_cast<float>(16 + F::OFFSET));
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* t = tiles + b / F::SUBS * F::TILE;
    const int j = static_cast<int>(b % F::SUBS);
    const uint8_t* q = t + F::QS + QS_BYTES * j;
    for (int l = 0; l < QS_BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH + l), _MM_HINT_T0);
    // w = s (q - offset) + mf = (16 s) v - (s (16 + offset) - mf), v = 1 + q / 16 (nibble_words).
    __m512 s, mf;
    F::scales(t, j, s, mf);
    const __m512 s16 = _mm512_mul_ps(sixteen, s), m = _mm512_fmsub_ps(s, shifted, mf);
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m512i w[4];
      gguf_dot::nibble_words<false>(_mm512_loadu_si512(q + 64 * c), w, none);
      for (int r = 0; r < R; ++r) {
        int32_t pair[4];  // the activation pairs of positions (0,1) .. (6,7)
        std::memcpy(pair, x + r * K + 32 * b + 8 * c, 16);
        even[r] = _mm512_dpbf16_ps(even[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[0])), reinterpret_cast<__m512bh>(w[0]));
        odd[r] = _mm512_dpbf16_ps(odd[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[1])), reinterpret_cast<__m512bh>(w[1]));
        even[r] = _mm512_dpbf16_ps(even[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[2])), reinterpret_cast<__m512bh>(w[2]));
        odd[r] = _mm512_dpbf16_ps(odd[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair[3])), reinterpret_cast<__m512bh>(w[3]));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), s16, acc[r]);
      acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xsum[r * (K / 32) + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

// Row i of a group written as bf16 to out[0, K): w = s (q - offset) + mf rounded once, as
// gguf_bf16's Dequant and gguf's own dequantize compute it.
template <typename F>
inline void dequantize_row(const uint8_t* tiles, int64_t K, int i, c10::BFloat16* out) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* t = tiles + b / F::SUBS * F::TILE;
    const int j = static_cast<int>(b % F::SUBS);
    __m512 sv, mv;
    F::scales(t, j, sv, mv);
    alignas(64) float s[16], mf[16];
    _mm512_store_ps(s, sv);
    _mm512_store_ps(mf, mv);
    for (int c = 0; c < 4; ++c)
      for (int k = 0; k < 4; ++k) {
        const uint8_t byte = t[F::QS + QS_BYTES * j + 64 * c + 4 * i + k];
        c10::BFloat16* o = out + 32 * b + 8 * c;
        o[LOW[k]] = c10::BFloat16(std::fma(s[i], static_cast<float>((byte & 15) - F::OFFSET), mf[i]));
        o[HIGH[k]] = c10::BFloat16(std::fma(s[i], static_cast<float>((byte >> 4) - F::OFFSET), mf[i]));
      }
  }
}

// A 16x16 matrix of dwords in 16 registers, transposed in place (unpacks within 128-bit lanes,
// then 128-bit lanes across registers).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // r[4g + q], lane L: inputs 4g..4g+3 of column 4L + q
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // column 4L + q: lane L of r[q], r[4 + q], r[8 + q], r[12 + q]
    const __m512i v0 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x44), v1 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xEE);
    t[q] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + q] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + q] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + q] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A dequantized sub-block's 16 position-pair registers ([p]: positions 2p, 2p + 1 of rows
// 0..15, from pair_bf16) written as the rows' 32 bf16 each: out + i * K for row i.
inline void store_rows(__m512i (&pairs)[16], c10::BFloat16* out, int64_t K) {
  transpose16(pairs);
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_si512(out + i * K, pairs[i]);
}

// fp32 values of two positions for 16 rows -> one register, dword i = (bf16 even i, bf16 odd i),
// each rounded to nearest even as gguf_bf16's Dequant rounds.
inline __m512i pair_bf16(__m512 even, __m512 odd) {
  // cvtne2ps(odd, even) holds even in words 0-15, odd in 16-31: word 2i <- i, 2i + 1 <- 16 + i.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}

// All 16 rows of a group into out (row stride K): a sub-block's codes of 16 rows at a time, as in
// `dot`, each register a position pair for the 16 rows; transposed, a row's 32 bf16 each.
template <typename F>
inline void dequantize_group(const uint8_t* tiles, int64_t K, c10::BFloat16* out) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), offset = _mm512_set1_epi32(F::OFFSET);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* t = tiles + b / F::SUBS * F::TILE;
    const int j = static_cast<int>(b % F::SUBS);
    __m512 s, mf;
    F::scales(t, j, s, mf);
    __m512i pairs[16];  // [4c + k]: positions 8c + 2k, 8c + 2k + 1 of rows 0..15
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(t + F::QS + QS_BYTES * j + 64 * c);
      for (int k = 0; k < 4; ++k) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi16(raw, SHIFT[k]), nibble);
        const __m512i qe = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xFFFF)), offset);
        const __m512i qo = _mm512_sub_epi32(_mm512_srli_epi32(q, 16), offset);
        const __m512 even = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(qe), mf);
        const __m512 odd = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(qo), mf);
        pairs[4 * c + k] = pair_bf16(even, odd);
      }
    }
    store_rows(pairs, out + 32 * b, K);
  }
}

}  // namespace gguf_rows16
#endif

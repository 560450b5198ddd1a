// Decode-sized GGUF block matmuls for bf16 activations on CPUs with AVX512-BF16: the activation
// layouts, the word helpers and the accumulators (included by gguf_ops.cpp after gguf_bf16.h,
// whose tables and scale unpacking they share; the formats' kernels: gguf_dot_formats.h).
//
// Every code becomes an exact bf16 value, vdpbf16ps sums exact products in fp32, and
// x . w = sum_subblocks s * dot(x, q) + m * sum(x). The activations are permuted once per call into
// the order in which 64 bytes of a weight row's codes come apart in registers, so no code is
// widened across lanes and every 32-bit lane of the products belongs to one sub-block: the
// sub-block scales apply once per register as a lane vector. 4- and 5-bit codes are read as
// 16-bit words straight into the bf16 mantissa (nibble_words); Q6_K and Q8_0 unpack bytes to
// words (vpunpck{l,h}bw within 128-bit lanes) and look them up in exact tables. Measured against
// the per-32-weight path it replaced: BENCHMARKS.md, "GGUF files computed on their blocks".
#pragma once
#ifdef SEGUE_GGUF_BF16

namespace gguf_dot {

using gguf_bf16::Table;
using gguf_bf16::load32;
using gguf_bf16::scales_mins;

// How a format's tiles of 64 codes map onto activation elements; one prepared copy of x per
// layout a call needs.
enum Layout : int {
  SUBBLOCK_PAIRS = 0,  // Q4_K, Q5_K: 64 bytes of nibbles hold sub-blocks 0-3 (or 4-7): (0,2) low, (1,3) high
  NATURAL = 1,         // Q6_K, Q8_0: 64 consecutive elements
  LEGACY_QUADS = 2,    // Q4_0..Q5_1: 4 blocks' 16 bytes of nibbles (elements 0-15 low, 16-31 high)
};
constexpr int LAYOUTS = 3;

inline int layout_of(int64_t t) {
  switch (t) {
    case Q4_K: case Q5_K: return SUBBLOCK_PAIRS;
    case Q6_K: case Q8_0: return NATURAL;
    default: return LEGACY_QUADS;
  }
}

// Prepared length of a row of K activations: whole tiles (4 legacy blocks, 2 Q8_0 blocks), zeros after K.
inline int64_t padded(int64_t K, int layout) {
  const int64_t tile = layout == LEGACY_QUADS ? 128 : 64;
  return (K + tile - 1) / tile * tile;
}

// Element e of a tile (byte e of its register of codes) is word pos(e) of the prepared tile.
// NATURAL: vpunpcklbw takes bytes 0-7 of each 128-bit lane, vpunpckhbw bytes 8-15. The nibble
// layouts read codes as 16-bit words (see nibble_words): even bytes, then odd ones.
struct Interleave {
  __m512i lo, hi;  // vpermt2w indices: prepared word p <- element e(p)
  explicit Interleave(bool unpack) {
    alignas(64) uint16_t idx[64];
    for (int p = 0; p < 64; ++p) {
      const int half = p / 32, lane = (p % 32) / 8, within = p % 8;
      idx[p] = static_cast<uint16_t>(unpack ? lane * 16 + half * 8 + within : 2 * (p % 32) + half);
    }
    lo = _mm512_load_si512(idx);
    hi = _mm512_load_si512(idx + 32);
  }
};

inline __m512i load_words(const uint16_t* p, int64_t n) {  // n of 32 words, zeros after
  return n >= 32 ? _mm512_loadu_si512(p)
                 : _mm512_maskz_loadu_epi16(n <= 0 ? 0 : static_cast<__mmask32>((1ull << n) - 1), p);
}

// x [K] (bf16 bits) -> out [padded(K, layout)] in the layout's tile order.
inline void prepare(const uint16_t* x, int64_t K, int layout, uint16_t* out) {
  static const Interleave unpacked(true), words(false);
  const Interleave& il = layout == NATURAL ? unpacked : words;
  const int64_t Kp = padded(K, layout);
  for (int64_t z = 0; z < Kp / 64; ++z) {
    __m512i a, b;  // elements 0-31 and 32-63 of tile z
    if (layout == NATURAL) {
      a = load_words(x + 64 * z, K - 64 * z);
      b = load_words(x + 64 * z + 32, K - 64 * z - 32);
    } else if (layout == SUBBLOCK_PAIRS) {
      static const int first[4] = {0, 1, 4, 5}, second[4] = {2, 3, 6, 7};
      const uint16_t* sb = x + 256 * (z / 4);
      a = _mm512_loadu_si512(sb + 32 * first[z % 4]);
      b = _mm512_loadu_si512(sb + 32 * second[z % 4]);
    } else {  // 16 elements of each of blocks 0-3 of the group, from offset 16 * half
      const int64_t g = z / 2, half = z % 2;
      __m256i part[4];
      for (int L = 0; L < 4; ++L) {
        const int64_t at = 128 * g + 32 * L + 16 * half;
        part[L] = at < K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + at)) : _mm256_setzero_si256();
      }
      a = _mm512_inserti64x4(_mm512_castsi256_si512(part[0]), part[1], 1);
      b = _mm512_inserti64x4(_mm512_castsi256_si512(part[2]), part[3], 1);
    }
    _mm512_storeu_si512(out + 64 * z, _mm512_permutex2var_epi16(a, il.lo, b));
    _mm512_storeu_si512(out + 64 * z + 32, _mm512_permutex2var_epi16(a, il.hi, b));
  }
}

// The bf16 words of a register of byte codes: low and high halves of each 128-bit lane.
inline __m512i words_lo(__m512i codes, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_unpacklo_epi8(codes, _mm512_setzero_si512()), table);
}
inline __m512i words_hi(__m512i codes, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_unpackhi_epi8(codes, _mm512_setzero_si512()), table);
}
inline __m512i words64_lo(__m512i codes, const Table& t) {
  return _mm512_permutex2var_epi16(t.lo, _mm512_unpacklo_epi8(codes, _mm512_setzero_si512()), t.hi);
}
inline __m512i words64_hi(__m512i codes, const Table& t) {
  return _mm512_permutex2var_epi16(t.lo, _mm512_unpackhi_epi8(codes, _mm512_setzero_si512()), t.hi);
}

// The four bf16 word registers of 64 bytes of nibbles, each code q (plus bit 4 where `fifth`, for
// 5-bit codes) as the bf16 1 + q / 2^bits: the code's bits go straight into the top of the
// mantissa (exponent 0), two shifts and a ternary-logic op a register, no table and no unpack.
// Words 0-3: the low nibbles of even bytes, of odd bytes, the high nibbles of even, of odd bytes.
// A format's sums take w = s q + m as (2^bits s) v + (m - 2^bits s); the products stay exact.
template <bool FIVE>
inline void nibble_words(__m512i raw, __m512i (&w)[4], const __mmask32 (&fifth)[4]) {
  const __m512i one = _mm512_set1_epi16(0x3F80), bits = _mm512_set1_epi16(FIVE ? 0x3C : 0x78);
  constexpr int k = FIVE ? 1 : 0;  // one place further down for 5-bit codes
  w[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(raw, 3 - k), bits, one, 0xEA);
  w[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 5 + k), bits, one, 0xEA);
  w[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 1 + k), bits, one, 0xEA);
  w[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 9 + k), bits, one, 0xEA);
  if constexpr (FIVE) {
    const __m512i top = _mm512_set1_epi16(0x40);
    for (int i = 0; i < 4; ++i) w[i] = _mm512_mask_add_epi16(w[i], fifth[i], w[i], top);
  }
}

// R rows of prepared activations and their accumulators for one output channel.
template <int R>
struct Dots {
  const uint16_t* x;   // [R, Kp] prepared
  int64_t Kp;
  const float* xsum;   // [R, K / 32] sums of x over 32-wide runs, natural order
  int64_t sums;        // K / 32
  __m512 acc[R], acc2[R];
  __m256 macc[R];

  // acc += s * sum_i dot(x[at + off[i] : +32], w[i]): the lanes of w[i] share s's lanes.
  template <int N, bool ODD = false>
  inline void tile(const __m512i (&w)[N], const int (&off)[N], int64_t at, __m512 s) {
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = x + r * Kp + at;
      __m512 t = _mm512_setzero_ps();
      for (int i = 0; i < N; ++i)
        t = _mm512_dpbf16_ps(t, reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + off[i])),
                             reinterpret_cast<__m512bh>(w[i]));
      if constexpr (ODD) acc2[r] = _mm512_fmadd_ps(t, s, acc2[r]);
      else acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
    }
  }
  // Min terms of up to eight 32-wide runs from run j: macc += m . sums.
  inline void mins8(int64_t j, __m256 m, __mmask8 live = 0xFF) {
    for (int r = 0; r < R; ++r)
      macc[r] = _mm256_fmadd_ps(m, _mm256_maskz_loadu_ps(live, xsum + r * sums + j), macc[r]);
  }
};

// Lane vector of a 16-lane tile whose lanes 0-7 take scale a and 8-15 scale b of s.
inline __m512 pair_scales(__m512 s, int a, int b) {
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1), s);
}
// Lanes 4L..4L+3 take scale first + L.
inline __m512 quad_scales(__m512 s, int first) {
  return _mm512_permutexvar_ps(
      _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_set1_epi32(first)), s);
}

// Weight bytes are hinted one 4 KiB page ahead of the super-block in use: hardware stream
// prefetchers (Intel's and AMD's alike) stop at page boundaries, so each thread's stream of rows
// would miss at every page. A page, not a tuned optimum: 2-16 KB ahead ran alike on a Zen 4.
constexpr int64_t PREFETCH = 4096;
static constexpr int PAIR[2] = {0, 32}, QUAD[4] = {0, 32, 64, 96}, Q8[4] = {0, 0, 32, 32};

}  // namespace gguf_dot
#endif

// Decode-sized GGUF block matmuls for bf16 activations on CPUs with AVX512-BF16 (included by
// gguf_ops.cpp after gguf_bf16.h, whose tables and scale unpacking it shares).
//
// The arithmetic is gguf_bf16.h's: every code q is an exact bf16 integer, vdpbf16ps sums exact
// products in fp32, and x . w = sum_subblocks s * dot(x, q) + m * sum(x). What differs is where
// the work goes. The activations are permuted once per call into the order in which a weight
// tile's codes come out of a 64-byte register (nibble halves, then vpunpck{l,h}bw within 128-bit
// lanes), so a tile of 64 codes becomes two registers of bf16 words with one unpack and one
// vpermw each, no lane-crossing widening, and every 32-bit lane of the products belongs to one
// sub-block: the sub-block scales are applied once per tile as a lane vector. On a Zen 4 EPYC
// this halved the nanoseconds per Q4_K super-block against per-32-weight chunks (bench in
// BENCHMARKS.md, "GGUF block kernels").
#pragma once
#ifdef SEGUE_GGUF_BF16

namespace gguf_dot {

using gguf_bf16::Table;
using gguf_bf16::load32;

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

// Weight bytes are fetched this far ahead of the super-block in use: the rows are one stream, and
// a hint a few pages ahead kept both cores' streams ~10% closer to their compute speed (Zen 4).
constexpr int64_t PREFETCH = 4096;
static constexpr int PAIR[2] = {0, 32}, QUAD[4] = {0, 32, 64, 96}, Q8[4] = {0, 0, 32, 32};

// gguf_bf16::scales_k4 in one register: bytes 0-7 the eight 6-bit scales, 8-15 the mins. Going
// through memory instead, two 32-bit stores feed each 64-bit load, which store forwarding cannot
// serve. Lanes of the 12 packed bytes: u0 u1 u2 (a fourth read past them, in the block, unused).
inline __m128i scales_mins(const uint8_t* packed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  // out = (u0 & 0x3f.., u2 & 0x0f.. | hi2(u0), u1 & 0x3f.., u2 >> 4 & 0x0f.. | hi2(u1)),
  // hi2(u): each byte's top two bits moved to bits 4-5.
  const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
  return _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                      _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

// Q4_K / Q5_K: per half super-block, 64 bytes of nibbles are sub-blocks (0,2) in their low
// nibbles and (1,3) in their high ones (or 4-7), 32 bytes each; Q5_K's fifth bits are bit
// (2 * chunk, +1 for high nibbles) of the byte of qh at the same position.
template <bool FIVE, int R>
inline void k_quant_nibbles(const uint8_t* row, int64_t K, Dots<R>& d) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  const __m256 scale = _mm256_set1_ps(FIVE ? 32.f : 16.f);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* b = row + sb * bytes;
    for (int l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH + l), _MM_HINT_T0);
    const __m128i sm = scales_mins(b + 4);
    const __m256 s8 = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_unpackhi_epi64(sm, sm))));
    d.mins8(sb * 8, _mm256_fnmadd_ps(scale, s8, m8));
    const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(scale, s8));
    const uint8_t* qs = b + (FIVE ? 48 : 16);
    const __m512i qh = FIVE ? _mm512_broadcast_i64x4(load32(b + 16)) : _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      __mmask32 fifth[4] = {};
      if constexpr (FIVE) {
        for (int i = 0; i < 4; ++i) {  // word i's bit: chunk 2h (words 0-15) or 2h+1, odd bytes in the high byte
          const int bit = 4 * h + (i >= 2 ? 1 : 0), byte = i % 2 ? 8 : 0;
          fifth[i] = _mm512_test_epi16_mask(qh, _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(1 << (bit + byte))),
                                            _mm256_set1_epi16(static_cast<short>(1 << (bit + 2 + byte))), 1));
        }
      }
      __m512i w[4];
      nibble_words<FIVE>(_mm512_loadu_si512(qs + 64 * h), w, fifth);
      const __m512i lo[2] = {w[0], w[1]}, hi[2] = {w[2], w[3]};
      const int64_t at = sb * 256 + 128 * h;
      d.tile(lo, PAIR, at, pair_scales(s, 4 * h, 4 * h + 2));
      d.template tile<2, true>(hi, PAIR, at + 64, pair_scales(s, 4 * h + 1, 4 * h + 3));
    }
  }
}

template <int R>
inline void super_blocks(int64_t t, const uint8_t* row, int64_t K, Dots<R>& d) {
  static const Table codes(0), q6_k(32);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if (t == Q6_K) {
    const __m512i m30 = _mm512_set1_epi8(0x30);
    // Bits 4-5 of a code: qh bits 0-1 / 2-3 for the low nibbles of ql's two halves, 4-5 / 6-7 for the high.
    const __m512i up = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), down = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* b = row + sb * 210;
      for (int l = 0; l < 210; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH + l), _MM_HINT_T0);
      const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
      for (int n = 0; n < 2; ++n) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * n);
        const __m512i qh = _mm512_broadcast_i64x4(load32(b + 128 + 32 * n));
        const __m512i qa = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi64(qh, up), m30));
        const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi64(qh, down), m30));
        const __m512i wa[2] = {words64_lo(qa, q6_k), words64_hi(qa, q6_k)};
        const __m512i wb[2] = {words64_lo(qb, q6_k), words64_hi(qb, q6_k)};
        const int64_t at = sb * 256 + 128 * n;
        d.tile(wa, PAIR, at, quad_scales(sc, 8 * n));
        d.template tile<2, true>(wb, PAIR, at + 64, quad_scales(sc, 8 * n + 4));
      }
    }
    return;
  }
  if (t == Q5_K) return k_quant_nibbles<true>(row, K, d);
  return k_quant_nibbles<false>(row, K, d);
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: eight blocks' fp16 scales (and mins) gathered at once, then two
// registers of four blocks' nibbles. Block L's code j has its fifth bit at bit j of its qh.
template <bool FIVE, int R>
inline void legacy_blocks(int64_t t, const Format& f, const uint8_t* row, int64_t K, Dots<R>& d) {
  const bool with_min = t == Q4_1 || t == Q5_1;
  // w = d (q - offset) + m = (2^bits d) v + (m - (2^bits + offset) d), v = 1 + q / 2^bits.
  const float levels = FIVE ? 32.f : 16.f, offset = with_min ? 0.f : levels / 2;
  const int64_t head = (with_min ? 4 : 2) + (FIVE ? 4 : 0), blocks = K / 32;
  const __m256i stride = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(static_cast<int>(f.bytes)));
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int64_t nb = std::min<int64_t>(8, blocks - b0);
    const __mmask8 live = static_cast<__mmask8>((1u << nb) - 1);
    const uint8_t* base = row + b0 * f.bytes;
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH + 128), _MM_HINT_T0);
    __m128i d16, m16;  // the eight blocks' fp16 d and m
    if constexpr (FIVE) {  // 22- or 24-byte blocks: four headers span more than a register
      const __m256i dm = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), live, stride, base, 1);
      d16 = _mm256_cvtepi32_epi16(dm);
      m16 = _mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16));
    } else {  // 18- or 20-byte blocks: blocks 0-3 and 4-7 each within one load, words picked by one permute
      const int64_t half = 4 * f.bytes, words = f.bytes / 2;
      const auto upto = [&](int64_t n) { return n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1; };
      const __m512i lo = _mm512_maskz_loadu_epi8(upto(nb * f.bytes), base);
      const __m512i hi = _mm512_maskz_loadu_epi8(upto(nb * f.bytes - half), base + half);
      // d of block i in word i, m in word 8 + i: word (i / 4) * 32 + (i % 4) * words (+ 1) of lo:hi.
      const __m512i idx = _mm512_add_epi16(
          _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                           33, 33, 33, 33, 1, 1, 1, 1, 32, 32, 32, 32, 0, 0, 0, 0),
          _mm512_mullo_epi16(_mm512_set1_epi16(static_cast<short>(words)),
                             _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0)));
      const __m512i picked = _mm512_permutex2var_epi16(lo, idx, hi);
      d16 = _mm512_castsi512_si128(picked);
      m16 = _mm512_extracti32x4_epi32(picked, 1);
    }
    const __m256 s8 = _mm256_cvtph_ps(d16);
    const __m256 m8 = with_min ? _mm256_cvtph_ps(m16) : _mm256_setzero_ps();
    d.mins8(b0, _mm256_fnmadd_ps(_mm256_set1_ps(levels + offset), s8, m8), live);
    const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(levels), s8));
    for (int64_t g = 0; g < nb; g += 4) {
      __m128i raw[4];
      __mmask32 fifth[4] = {};
      for (int L = 0; L < 4; ++L) {
        const bool here = g + L < nb;
        const uint8_t* b = base + (g + L) * f.bytes;
        raw[L] = here ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + head)) : _mm_setzero_si128();
        if (FIVE && here) {
          uint32_t qh;
          std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
          // Words 0-3: codes 0, 2, .. 14 / 1, 3, .. 15 / 16, 18, .. 30 / 17, .. 31 of each block.
          static constexpr uint32_t pick[4] = {0x5555u, 0xAAAAu, 0x55550000u, 0xAAAA0000u};
          for (int i = 0; i < 4; ++i) fifth[i] |= _pext_u32(qh, pick[i]) << (8 * L);
        }
      }
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_set_m128i(raw[1], raw[0])), _mm256_set_m128i(raw[3], raw[2]), 1);
      __m512i w[4];
      nibble_words<FIVE>(v, w, fifth);
      if (g) d.template tile<4, true>(w, QUAD, (b0 + g) * 32, quad_scales(s, static_cast<int>(g)));
      else d.tile(w, QUAD, (b0 + g) * 32, quad_scales(s, 0));
    }
  }
}

// Q8_0: a signed code q = 16 * (q >> 4) + (q & 15); both nibbles go through exact tables (the high
// one holding 16 times its signed value), and two tiles of words dot the same activations.
template <int R>
inline void q8_0_blocks(const uint8_t* row, int64_t K, Dots<R>& d) {
  static const Table unsigned_codes(0);
  static const __m512i high = [] {
    alignas(64) uint16_t v[32];
    for (int i = 0; i < 32; ++i) {
      const float x = 16.f * static_cast<float>(i < 8 ? i : i < 16 ? i - 16 : 0);
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v[i] = static_cast<uint16_t>(bits >> 16);
    }
    return _mm512_load_si512(v);
  }();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int64_t blocks = K / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const uint8_t* b = row + b0 * 34;
    const bool pair = b0 + 1 < blocks;
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b + 2)),
                                         pair ? load32(b + 36) : _mm256_setzero_si256(), 1);
    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    const __m512i w[4] = {words_lo(lo, unsigned_codes.lo), words_lo(hi, high),
                          words_hi(lo, unsigned_codes.lo), words_hi(hi, high)};
    const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(f16(b)), _mm256_set1_ps(pair ? f16(b + 34) : 0.f), 1);
    if (b0 % 4) d.template tile<4, true>(w, Q8, b0 * 32, s);
    else d.tile(w, Q8, b0 * 32, s);
  }
}

template <int R>
inline void channel_r(int64_t t, const Format& f, const uint8_t* row, int64_t K, const uint16_t* x, int64_t Kp,
                      const float* xsum, float* out, int64_t stride) {
  Dots<R> d{x, Kp, xsum, K / 32, {}, {}, {}};
  for (int r = 0; r < R; ++r) {
    d.acc[r] = d.acc2[r] = _mm512_setzero_ps();
    d.macc[r] = _mm256_setzero_ps();
  }
  if (t == Q8_0) q8_0_blocks(row, K, d);
  else if (f.block == 256) super_blocks(t, row, K, d);
  else if (t == Q5_0 || t == Q5_1) legacy_blocks<true>(t, f, row, K, d);
  else legacy_blocks<false>(t, f, row, K, d);
  for (int r = 0; r < R; ++r)
    out[r * stride] = _mm512_reduce_add_ps(_mm512_add_ps(d.acc[r], d.acc2[r])) +
                      _mm512_reduce_add_ps(_mm512_zextps256_ps512(d.macc[r]));
}

// Rows [0, mb) of prepared x (mb <= 8) against weight row `row`; writes out[r * stride].
inline void channel(int64_t t, const Format& f, const uint8_t* row, int64_t K, const uint16_t* x, int64_t Kp,
                    const float* xsum, int64_t mb, float* out, int64_t stride) {
  switch (mb) {
    case 1: return channel_r<1>(t, f, row, K, x, Kp, xsum, out, stride);
    case 2: return channel_r<2>(t, f, row, K, x, Kp, xsum, out, stride);
    case 3: return channel_r<3>(t, f, row, K, x, Kp, xsum, out, stride);
    case 4: return channel_r<4>(t, f, row, K, x, Kp, xsum, out, stride);
    case 5: return channel_r<5>(t, f, row, K, x, Kp, xsum, out, stride);
    case 6: return channel_r<6>(t, f, row, K, x, Kp, xsum, out, stride);
    case 7: return channel_r<7>(t, f, row, K, x, Kp, xsum, out, stride);
    default: return channel_r<8>(t, f, row, K, x, Kp, xsum, out, stride);
  }
}

}  // namespace gguf_dot
#endif

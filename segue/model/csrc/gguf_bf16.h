// GGUF blocks as bf16 on CPUs with AVX512-BF16 (included by gguf_ops.cpp): the code tables and
// scale unpacking the dot products (gguf_dot.h) share, and a prefill's per-call dequantization.
//
// Every format's integers q are exact in bf16, and a bf16 activation times a bf16 integer is exact
// in fp32, so vdpbf16ps (32 multiply-adds an instruction, twice an fp32 FMA's) sums the same
// products the fp32 path does. Here each 32-weight chunk's q go from nibbles (or 5-, 6-, 8-bit
// codes) to bf16 words with a byte widening and one table lookup (vpermw), in natural order.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__BMI2__)
#define SEGUE_GGUF_BF16 1
#include <immintrin.h>

namespace gguf_bf16 {

// bf16 bit patterns of (i - offset) for i in [0, 64): the lookup table of one format's codes.
struct Table {
  __m512i lo, hi;
  explicit Table(int offset) {
    alignas(64) uint16_t t[64];
    for (int i = 0; i < 64; ++i) {
      const float v = static_cast<float>(i - offset);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have no low mantissa bits
    }
    lo = _mm512_load_si512(t);
    hi = _mm512_load_si512(t + 32);
  }
  // 32 codes in [0, 64) (one per byte) -> 32 bf16 values.
  inline __m512i operator()(__m256i codes) const {
    return _mm512_permutex2var_epi16(lo, _mm512_cvtepu8_epi16(codes), hi);
  }
  // The same for codes below 32: one table register.
  inline __m512i small(__m256i codes) const { return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), lo); }
};

inline __m256i nib_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i nib_hi(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// A legacy block's 16 bytes of nibbles -> its 32 codes in element order (low nibbles, then high).
inline __m256i codes32(const uint8_t* p) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
}

// The 8 six-bit scales and 8 mins of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4 for all j
// at once) in one register: bytes 0-7 the scales, 8-15 the mins. Going through memory instead,
// two 32-bit stores feed each 64-bit load, which store forwarding cannot serve. Lanes of the 12
// packed bytes: u0 u1 u2 (a fourth read past them, in the block, unused).
inline __m128i scales_mins(const uint8_t* packed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  // out = (u0 & 0x3f.., u2 & 0x0f.. | hi2(u0), u1 & 0x3f.., u2 >> 4 & 0x0f.. | hi2(u1)),
  // hi2(u): each byte's top two bits moved to bits 4-5.
  const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
  return _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                      _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

// A block's weights written out as bf16, w = s * q + m rounded once (a prefill's per-call dense
// weight), chunk by chunk of 32 codes as bf16 words in natural order.
struct Dequant {
  c10::BFloat16* out;   // this row's K outputs
  __m256 mins = _mm256_setzero_ps();
  float min = 0.f;

  inline void mins8(__m256 m) { mins = m; }
  inline void min1(float m) { min = m; }
  inline void chunk(int64_t k, __m512i w, __m512 s) {
    // The sub-block's min: one of the super-block's eight (32-wide sub-blocks), or the block's.
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mins);
    const float m = min != 0.f ? min : m8[(k / 32) % 8];
    const __m512 mv = _mm512_set1_ps(m);
    // bf16 words -> fp32: the bits shifted to the top half.
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
    // s: lane i scales pair i, so elements 0-15 take lane 0's scale and 16-31 lane 8's.
    const __m512 s_lo = _mm512_permutexvar_ps(_mm512_setzero_si512(), s);
    const __m512 s_hi = _mm512_permutexvar_ps(_mm512_set1_epi32(8), s);
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(s_hi, hi, mv), _mm512_fmadd_ps(s_lo, lo, mv));
    _mm512_storeu_si512(out + k, reinterpret_cast<__m512i>(v));
  }
};

// One block of type t at column k0 written out by the sink. Forced inline into dequantize_row's
// loop (GCC calls the switch over every type out of line).
__attribute__((always_inline)) inline void block(int64_t t, const uint8_t* b, int64_t k0, Dequant& sink) {
  static const Table unsigned_codes(0), q4_0(8), q5_0(16), q6_k(32);
  switch (t) {
    case Q4_K: case Q5_K: {
      const bool five = t == Q5_K;
      const __m128i sm = scales_mins(b + 4);
      alignas(32) float sc[8];
      _mm256_store_ps(sc, _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
      const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_unpackhi_epi64(sm, sm))));
      sink.mins8(mins);
      const uint8_t* qs = b + (five ? 48 : 16);
      const __m256i qh = five ? load32(b + 16) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i v = load32(qs + 32 * c), lo = nib_lo(v), hi = nib_hi(v);
        if (five) {
          const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
          const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
          const __m256i sixteen = _mm256_set1_epi8(16);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        sink.chunk(k0 + 64 * c, unsigned_codes.small(lo), _mm512_set1_ps(sc[2 * c]));
        sink.chunk(k0 + 64 * c + 32, unsigned_codes.small(hi), _mm512_set1_ps(sc[2 * c + 1]));
      }
      return;
    }
    case Q6_K: {
      const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
      const __m256i m30 = _mm256_set1_epi8(0x30);
      for (int n = 0; n < 2; ++n) {
        const __m256i ql0 = load32(b + 64 * n), ql1 = load32(b + 64 * n + 32), qh = load32(b + 128 + 32 * n);
        const __m256i codes[4] = {
            _mm256_or_si256(nib_lo(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
            _mm256_or_si256(nib_lo(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
            _mm256_or_si256(nib_hi(ql0), _mm256_and_si256(qh, m30)),
            _mm256_or_si256(nib_hi(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
        for (int j = 0; j < 4; ++j) {
          // Sub-blocks of 16: the chunk's first 8 lanes (pairs) take one scale, the last 8 the next.
          const int s = 8 * n + 2 * j;
          const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(s), _mm256_set1_epi32(s + 1), 1);
          if (j % 2) sink.chunk(k0 + 128 * n + 32 * j, q6_k(codes[j]), _mm512_permutexvar_ps(idx, sc));
          else sink.chunk(k0 + 128 * n + 32 * j, q6_k(codes[j]), _mm512_permutexvar_ps(idx, sc));
        }
      }
      return;
    }
    case Q4_0: case Q4_1: {
      const bool with_min = t == Q4_1;
      const __m256i codes = codes32(b + (with_min ? 4 : 2));
      if (with_min) sink.min1(f16(b + 2));
      sink.chunk(k0, (with_min ? unsigned_codes : q4_0).small(codes), _mm512_set1_ps(f16(b)));
      return;
    }
    case Q5_0: case Q5_1: {
      const bool with_min = t == Q5_1;
      const uint8_t* hb = b + (with_min ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, hb, 4);
      __m256i codes = codes32(hb + 4);
      codes = _mm256_or_si256(codes, _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(16)));
      if (with_min) sink.min1(f16(b + 2));
      sink.chunk(k0, (with_min ? unsigned_codes : q5_0).small(codes), _mm512_set1_ps(f16(b)));
      return;
    }
    case Q8_0: {
      const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
      const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
      sink.chunk(k0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(c, a)), _mm512_set1_ps(f16(b)));
      return;
    }
    default: TORCH_CHECK(false, "gguf kernels: unsupported ggml type ", t);
  }
}

// Weight row `row` (K weights of type t) dequantized to bf16 into out[0, K).
inline void dequantize_row(int64_t t, const Format& f, const uint8_t* row, int64_t K, c10::BFloat16* out) {
  Dequant sink{out};
  for (int64_t b = 0; b < K / f.block; ++b) {
    sink.min = 0.f;
    block(t, row + b * f.bytes, b * f.block, sink);
  }
}

}  // namespace gguf_bf16
#endif

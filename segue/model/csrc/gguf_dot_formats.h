// Each GGUF format's decode kernel on prepared activations, and the per-row entry point (included
// by gguf_ops.cpp after gguf_dot.h: the layouts, word helpers and accumulators they use).
#pragma once
#ifdef SEGUE_GGUF_BF16

namespace gguf_dot {

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

// Q6_K: six-bit codes from ql's nibbles and qh's bit pairs, unpacked to words and looked up in an
// exact table of q - 32.
template <int R>
inline void q6_k_blocks(const uint8_t* row, int64_t K, Dots<R>& d) {
  static const Table q6_k(32);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
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
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: eight blocks' fp16 scales (and mins) read at once, then two
// registers of four blocks' nibbles. Block L's code j has its fifth bit at bit j of its qh.
template <bool FIVE, int R>
inline void legacy_blocks(int64_t t, const Format& f, const uint8_t* row, int64_t K, Dots<R>& d) {
  const bool with_min = t == Q4_1 || t == Q5_1;
  // w = d (q - offset) + m = (2^bits d) v + (m - (2^bits + offset) d), v = 1 + q / 2^bits.
  const float levels = FIVE ? 32.f : 16.f, offset = with_min ? 0.f : levels / 2;
  const int64_t head = (with_min ? 4 : 2) + (FIVE ? 4 : 0), blocks = K / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int64_t nb = std::min<int64_t>(8, blocks - b0);
    const __mmask8 live = static_cast<__mmask8>((1u << nb) - 1);
    const uint8_t* base = row + b0 * f.bytes;
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(base + PREFETCH + 128), _MM_HINT_T0);
    __m128i d16, m16;  // the eight blocks' fp16 d and m
    if constexpr (FIVE) {  // 22- or 24-byte blocks: four headers span more than a register
      const __m256i stride = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_epi32(static_cast<int>(f.bytes)));
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
  else if (t == Q6_K) q6_k_blocks(row, K, d);
  else if (t == Q5_K) k_quant_nibbles<true>(row, K, d);
  else if (t == Q4_K) k_quant_nibbles<false>(row, K, d);
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

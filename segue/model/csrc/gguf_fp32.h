// GGUF block matmuls for fp32 activations, on any CPU (included by gguf_ops.cpp): each block is
// unpacked to int8 codes with fp32 scales and mins in L1, then dotted against the activation rows
// (one row converts the codes on the fly, several rows share a dequantized fp32 copy of the block).
#pragma once

namespace {

// ggml's get_scale_min_k4: 8 six-bit (scale, min) pairs packed in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block -> q[block] as int8, s[block / sub] and m[block / sub] with w = s * q + m.
void unpack(int64_t t, const uint8_t* b, int8_t* q, float* s, float* m) {
  switch (t) {
    case Q4_0: case Q4_1: {
      const bool with_min = t == Q4_1;
      const uint8_t* qs = b + (with_min ? 4 : 2);
      const int off = with_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>((qs[j] & 15) - off);
        q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
      }
      s[0] = f16(b);
      m[0] = with_min ? f16(b + 2) : 0.f;
      return;
    }
    case Q5_0: case Q5_1: {
      const bool with_min = t == Q5_1;
      const uint8_t* hb = b + (with_min ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, hb, 4);
      const uint8_t* qs = hb + 4;
      const int off = with_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
        q[j] = static_cast<int8_t>(((qs[j] & 15) | h0) - off);
        q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | h1) - off);
      }
      s[0] = f16(b);
      m[0] = with_min ? f16(b + 2) : 0.f;
      return;
    }
    case Q8_0:
      std::memcpy(q, b + 2, 32);
      s[0] = f16(b);
      m[0] = 0.f;
      return;
    case Q4_K: case Q5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* scales = b + 4;
      const bool five = t == Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c) {
        const uint8_t* ql = qs + 32 * c;
        int8_t* lo = q + 64 * c;
        int8_t* hi = lo + 32;
        for (int l = 0; l < 32; ++l) {
          lo[l] = static_cast<int8_t>(ql[l] & 15);
          hi[l] = static_cast<int8_t>(ql[l] >> 4);
        }
        if (five) {
          for (int l = 0; l < 32; ++l) {
            lo[l] = static_cast<int8_t>(lo[l] | (((qh[l] >> (2 * c)) & 1) << 4));
            hi[l] = static_cast<int8_t>(hi[l] | (((qh[l] >> (2 * c + 1)) & 1) << 4));
          }
        }
      }
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, scales, sc, mn);
        s[j] = d * static_cast<float>(sc);
        m[j] = -(dmin * static_cast<float>(mn));
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* l8 = ql + 64 * n;
        const uint8_t* h8 = qh + 32 * n;
        int8_t* y = q + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = static_cast<int8_t>(((l8[l] & 15) | ((h8[l] & 3) << 4)) - 32);
          y[l + 32] = static_cast<int8_t>(((l8[l + 32] & 15) | (((h8[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = static_cast<int8_t>(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = static_cast<int8_t>(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
        }
      }
      for (int j = 0; j < 16; ++j) s[j] = d * static_cast<float>(sc[j]), m[j] = 0.f;
      return;
    }
    default: TORCH_CHECK(false, "gguf kernels: unsupported ggml type ", t);
  }
}

// w[i] = s * q[i] + m for one unpacked block, as gguf's dequantize computes it.
inline void expand(const int8_t* q, const float* s, const float* m, int64_t n, int64_t sub, float* w) {
  for (int64_t j = 0; j < n / sub; ++j)
    for (int64_t i = 0; i < sub; ++i) w[j * sub + i] = s[j] * static_cast<float>(q[j * sub + i]) + m[j];
}

#ifdef __AVX512F__
inline __m512 q16(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
#endif

// One activation row against one unpacked block: sum_j s_j dot(x_j, q_j) + m_j sum(x_j), where
// xsum holds the row's sums over 16-wide runs. `acc` is a vector accumulator where the ISA has one.
#ifdef __AVX512F__
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
inline void dot_block(const int8_t* q, const float* s, const float* m, int64_t n, int64_t sub, const float* x,
                      const float* xsum, Acc& acc, float& macc) {
  if (sub == 16) {
    for (int64_t j = 0; j < n / 16; ++j) {
      acc = _mm512_fmadd_ps(_mm512_mul_ps(q16(q + 16 * j), _mm512_loadu_ps(x + 16 * j)), _mm512_set1_ps(s[j]), acc);
      macc += m[j] * xsum[j];
    }
  } else {
    for (int64_t j = 0; j < n / 32; ++j) {
      __m512 t = _mm512_mul_ps(q16(q + 32 * j), _mm512_loadu_ps(x + 32 * j));
      t = _mm512_fmadd_ps(q16(q + 32 * j + 16), _mm512_loadu_ps(x + 32 * j + 16), t);
      acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[j]), acc);
      macc += m[j] * (xsum[2 * j] + xsum[2 * j + 1]);
    }
  }
}
inline void dot_dense(const float* w, const float* x, int64_t n, Acc& acc) {
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc);
}
#elif defined(__AVX2__)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
inline __m256 q8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline void dot_block(const int8_t* q, const float* s, const float* m, int64_t n, int64_t sub, const float* x,
                      const float* xsum, Acc& acc, float& macc) {
  for (int64_t j = 0; j < n / sub; ++j) {
    __m256 t = _mm256_setzero_ps();
    for (int64_t i = 0; i < sub; i += 8) t = _mm256_fmadd_ps(q8(q + sub * j + i), _mm256_loadu_ps(x + sub * j + i), t);
    acc = _mm256_fmadd_ps(t, _mm256_set1_ps(s[j]), acc);
    float xs = 0.f;
    for (int64_t r = 0; r < sub / 16; ++r) xs += xsum[j * (sub / 16) + r];
    macc += m[j] * xs;
  }
}
inline void dot_dense(const float* w, const float* x, int64_t n, Acc& acc) {
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
}
#else
using Acc = float;
inline Acc acc_zero() { return 0.f; }
inline float acc_sum(Acc a) { return a; }
inline void dot_block(const int8_t* q, const float* s, const float* m, int64_t n, int64_t sub, const float* x,
                      const float* xsum, Acc& acc, float& macc) {
  for (int64_t j = 0; j < n / sub; ++j) {
    float t = 0.f;
    for (int64_t i = 0; i < sub; ++i) t += static_cast<float>(q[sub * j + i]) * x[sub * j + i];
    acc += t * s[j];
    float xs = 0.f;
    for (int64_t r = 0; r < sub / 16; ++r) xs += xsum[j * (sub / 16) + r];
    macc += m[j] * xs;
  }
}
inline void dot_dense(const float* w, const float* x, int64_t n, Acc& acc) {
  for (int64_t i = 0; i < n; ++i) acc += w[i] * x[i];
}
#endif

// Rows [m0, m0 + mb) of x against weight row `row` (K / block blocks of type t).
void channel(int64_t t, const Format& f, const uint8_t* row, int64_t K, const float* x, const float* xsum,
             int64_t mb, float* out, int64_t out_stride) {
  alignas(64) int8_t q[MAXB];
  alignas(64) float w[MAXB];
  float s[MAXS], m[MAXS];
  Acc acc[MB];
  float macc[MB];
  for (int64_t r = 0; r < mb; ++r) acc[r] = acc_zero(), macc[r] = 0.f;
  const int64_t blocks = K / f.block;
  for (int64_t b = 0; b < blocks; ++b) {
    unpack(t, row + b * f.bytes, q, s, m);
    const int64_t k0 = b * f.block;
    if (mb == 1) {
      dot_block(q, s, m, f.block, f.sub, x + k0, xsum + k0 / 16, acc[0], macc[0]);
    } else {  // several rows: dequantize once, then plain fp32 dots
      expand(q, s, m, f.block, f.sub, w);
      for (int64_t r = 0; r < mb; ++r) dot_dense(w, x + r * K + k0, f.block, acc[r]);
    }
  }
  for (int64_t r = 0; r < mb; ++r) out[r * out_stride] = acc_sum(acc[r]) + macc[r];
}


}  // namespace

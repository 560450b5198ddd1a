// Weight-only quantized matmuls for small batches on CPUs: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
// A decode step of a small model streams every weight once, so the step time is the weight bytes
// over memory bandwidth: int8 reads about a quarter of fp32's bytes, int4 an eighth. Both formats
// use groups of 32 along K, as llama.cpp's Q8_0 (int8: w = q * scale) and Q4_1 (int4:
// w = q * scale + lo) do, so GGUF weights in those formats are represented exactly.
// Dequantization is fused into the dot products with fp32 accumulation; each thread owns a slice
// of output channels and decodes each group once for all M activation rows (M is small: large
// batches are compute-bound and run the fp32 GEMM instead; the Python side picks).
#include <torch/extension.h>
#include <omp.h>
#include "avx2_common.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <vector>

namespace {

constexpr int64_t G = 32;     // group size along K
constexpr int64_t MB = 8;     // activation rows per pass over a weight row

// 32 weights of one group as fp32 in w[0..31]; the AVX2 path keeps them in registers instead.
inline void decode_int8(const int8_t* q, float* w) {
  for (int64_t j = 0; j < G; ++j) w[j] = static_cast<float>(q[j]);
}
inline void decode_int4(const uint8_t* b, float* w) {
  for (int64_t j = 0; j < G / 2; ++j) {
    w[j] = static_cast<float>(b[j] & 15);
    w[j + G / 2] = static_cast<float>(b[j] >> 4);
  }
}

#ifdef __AVX2__
inline void decode_int8_avx(const int8_t* q, __m256* w) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
}
inline void decode_int4_avx(const uint8_t* b, __m256* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

// One output channel n for rows [m0, m0 + mb): out[m, n] = sum_g scale_g * dot(x_g, q_g) (+ lo_g * sum(x_g)).
template <bool INT4>
void channel(const void* row, const float* scales, int64_t groups, const float* x, const float* xsum, int64_t K,
             int64_t mb, float* out, int64_t out_stride) {
#ifdef __AVX2__
  __m256 acc[MB];
  float lo_acc[MB];
  for (int64_t m = 0; m < mb; ++m) acc[m] = _mm256_setzero_ps(), lo_acc[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 w[4];
    if constexpr (INT4) decode_int4_avx(static_cast<const uint8_t*>(row) + g * (G / 2), w);
    else decode_int8_avx(static_cast<const int8_t*>(row) + g * G, w);
    const __m256 s = _mm256_set1_ps(scales[INT4 ? 2 * g : g]);
    for (int64_t m = 0; m < mb; ++m) {
      const float* xg = x + m * K + g * G;
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xg), w[0]);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w[1], t);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w[2], t);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w[3], t);
      acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
      if constexpr (INT4) lo_acc[m] += xsum[m * groups + g] * scales[2 * g + 1];
    }
  }
  for (int64_t m = 0; m < mb; ++m) out[m * out_stride] = hsum(acc[m]) + lo_acc[m];
#else
  float w[G];
  float acc[MB] = {0.f};
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (INT4) decode_int4(static_cast<const uint8_t*>(row) + g * (G / 2), w);
    else decode_int8(static_cast<const int8_t*>(row) + g * G, w);
    const float s = scales[INT4 ? 2 * g : g];
    for (int64_t m = 0; m < mb; ++m) {
      const float* xg = x + m * K + g * G;
      float t = 0.f;
      for (int64_t j = 0; j < G; ++j) t += xg[j] * w[j];
      acc[m] += t * s;
      if constexpr (INT4) acc[m] += xsum[m * groups + g] * scales[2 * g + 1];
    }
  }
  for (int64_t m = 0; m < mb; ++m) out[m * out_stride] = acc[m];
#endif
}

template <bool INT4>
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % G == 0, "quantized linear: x must be [M, K] with K % 32 == 0");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32,
              "quantized linear: weights and fp32 scales must be contiguous");
  // bf16/fp16 activations are widened once per call, not once per weight row.
  const auto xf = x.scalar_type() == torch::kFloat32 ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), groups = K / G;
  TORCH_CHECK(q.size(1) * (INT4 ? 2 : 1) == K && scales.numel() == N * groups * (INT4 ? 2 : 1),
              "quantized linear: weight shape does not match x");
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum;
  if (INT4) {  // sum_j x_j (q_j s + lo) = s sum_j x_j q_j + lo sum_j x_j
    xsum.resize(M * groups);
    for (int64_t i = 0; i < M * groups; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += xp[i * G + j];
      xsum[i] = s;
    }
  }
  auto out = torch::empty({M, N}, xf.options());
  float* op = out.data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  const int64_t row_bytes = INT4 ? K / 2 : K, scale_row = groups * (INT4 ? 2 : 1);
  const float* sp = scales.data_ptr<float>();
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      channel<INT4>(qp + n * row_bytes, sp + n * scale_row, groups, xp + m0 * K,
                    INT4 ? xsum.data() + m0 * groups : nullptr, K, std::min(MB, M - m0), op + m0 * N + n, N);
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

}  // namespace

// q [N, K] int8, scales [N, K / 32] fp32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "int8_linear: q must be int8");
  return quant_linear<false>(x, q, scale);
}

// packed [N, K / 2] uint8: byte j of group g holds element 32g + j (low nibble) and 32g + j + 16
// (high nibble); scale_lo [N, K / 32, 2] fp32 (scale, lo).
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_lo) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "int4_linear: packed must be uint8");
  return quant_linear<true>(x, packed, scale_lo);
}

// Matmuls that read GGUF (ggml) block-quantized weights as the file stores them:
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.
//
// Decoding one sequence streams every weight byte once per token, so the step time is the file's
// bytes over memory bandwidth; expanding K-quants to bf16 at load time reads 3-4x the bytes. Every
// format here is w = s * q + m per sub-block of 16 or 32 weights, with small integers q and fp32
// s, m that are exact products of the file's fp16 and 6-bit factors (as gguf's own dequantize
// computes them), so the sums below are those of the dequantized weights up to fp32 rounding:
//   sum_k x_k w_k = sum_subblocks s * dot(x, q) + m * sum(x).
// A super-block (256 weights, or 32 for the legacy formats) is unpacked to int8 q in L1, then
// dotted against each activation row; one row converts q on the fly, several rows share a
// dequantized fp32 copy of the super-block. Threads own slices of output channels.
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cstring>
#include <vector>

namespace {

// ggml_type ids.
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t block;     // weights per block
  int64_t bytes;     // bytes per block
  int64_t sub;       // weights per scale
};

Format format_of(int64_t t) {
  switch (t) {
    case Q4_0: return {32, 18, 32};
    case Q4_1: return {32, 20, 32};
    case Q5_0: return {32, 22, 32};
    case Q5_1: return {32, 24, 32};
    case Q8_0: return {32, 34, 32};
    case Q4_K: return {256, 144, 32};
    case Q5_K: return {256, 176, 32};
    case Q6_K: return {256, 210, 16};
    default: TORCH_CHECK(false, "gguf kernels: unsupported ggml type ", t);
  }
}

constexpr int64_t MAXB = 256, MAXS = MAXB / 16, MB = 8;

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

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
#include "gguf_bf16.h"
#include "gguf_dot.h"
namespace {

void check_segment(const torch::Tensor& blocks, int64_t t, int64_t K) {
  const Format f = format_of(t);
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf kernels: blocks must be a contiguous [N, row_bytes] uint8 tensor");
  TORCH_CHECK(K % f.block == 0 && blocks.size(1) == K / f.block * f.bytes,
              "gguf kernels: a row of ", K, " weights of type ", t, " is not ", blocks.size(1), " bytes");
}

}  // namespace

// x [M, K] (any float dtype) against the row-wise concatenation of `segments` (each [N_i, row_bytes]
// uint8 holding ggml blocks of type types[i]): [M, sum N_i] in fp32.
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> segments, std::vector<int64_t> types,
                          bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "gguf_linear: x must be [M, K] with K % 32 == 0");
  TORCH_CHECK(segments.size() == types.size() && !segments.empty(), "gguf_linear: one type per segment");
#ifdef SEGUE_GGUF_BF16
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
#else
  const bool bf16 = false;
#endif
  // fp16 activations are widened once per call; bf16 ones are dotted as they are where the CPU can.
  const auto xc = bf16 || x.scalar_type() == torch::kFloat32 ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), S = static_cast<int64_t>(segments.size());
  std::vector<int64_t> starts(S + 1, 0);
  std::vector<Format> formats;
  std::vector<const uint8_t*> bases;
  std::vector<int64_t> row_bytes;
  for (int64_t i = 0; i < S; ++i) {
    check_segment(segments[i], types[i], K);
    formats.push_back(format_of(types[i]));
    bases.push_back(segments[i].data_ptr<uint8_t>());
    row_bytes.push_back(segments[i].size(1));
    starts[i + 1] = starts[i] + segments[i].size(0);
  }
  const int64_t N = starts[S];
  // Sums of x over 16-wide runs (32-wide for the bf16 path): the min term of every format.
  const int64_t run = bf16 ? 32 : 16;
  std::vector<float> xsum(M * (K / run));
  const float* xp = bf16 ? nullptr : xc.data_ptr<float>();
  const auto* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr()) : nullptr;
  for (int64_t i = 0; i < M * (K / run); ++i) {
#ifdef SEGUE_GGUF_BF16
    if (bf16) {  // 32 bf16 -> two fp32 registers (the bits shifted to the top half)
      const __m512i w = _mm512_loadu_si512(xb + i * 32);
      const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
      const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
      xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      continue;
    }
#endif
    float a = 0.f;
    for (int64_t j = 0; j < run; ++j) a += xp[i * run + j];
    xsum[i] = a;
  }
#ifdef SEGUE_GGUF_BF16
  // bf16 activations in each layout the segments' formats read, once per call (gguf_dot.h).
  std::vector<uint16_t> prepared[gguf_dot::LAYOUTS];
  int64_t prepared_k[gguf_dot::LAYOUTS] = {};
  for (int64_t i = 0; bf16 && i < S; ++i) {
    const int layout = gguf_dot::layout_of(types[i]);
    if (!prepared[layout].empty()) continue;
    const int64_t Kp = gguf_dot::padded(K, layout);
    prepared_k[layout] = Kp;
    prepared[layout].resize(M * Kp);
    for (int64_t r = 0; r < M; ++r) gguf_dot::prepare(xb + r * K, K, layout, prepared[layout].data() + r * Kp);
  }
#endif
  // bf16 activations get bf16 outputs (the next op's dtype) unless fp32 is asked for (logits).
  const bool out_bf16 = bf16 && !fp32_out;
  auto out = torch::empty({M, N}, xc.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  float* op = out_bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = out_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t n = 0; n < N; ++n) {
    int64_t seg = 0;
    while (n >= starts[seg + 1]) ++seg;
    const uint8_t* row = bases[seg] + (n - starts[seg]) * row_bytes[seg];
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
#ifdef SEGUE_GGUF_BF16
      if (bf16) {
        float o[MB];
        const int layout = gguf_dot::layout_of(types[seg]);
        const int64_t Kp = prepared_k[layout];
        gguf_dot::channel(types[seg], formats[seg], row, K, prepared[layout].data() + m0 * Kp, Kp,
                          xsum.data() + m0 * (K / 32), mb, o, 1);
        for (int64_t r = 0; r < mb; ++r) {
          if (out_bf16) ob[(m0 + r) * N + n] = c10::BFloat16(o[r]);
          else op[(m0 + r) * N + n] = o[r];
        }
        continue;
      }
#endif
      channel(types[seg], formats[seg], row, K, xp + m0 * K, xsum.data() + m0 * (K / 16), mb, op + m0 * N + n, N);
    }
  }
  return out;
}

// Rows `ids` (all rows when empty) of a [N, row_bytes] block tensor, dequantized to `dtype`
// ([len(ids), K]): a prefill's dense weight one layer at a time, or embedding lookups.
torch::Tensor gguf_dequantize(torch::Tensor blocks, int64_t type, int64_t K, torch::Tensor ids, c10::ScalarType dtype,
                              c10::optional<torch::Tensor> into) {
  check_segment(blocks, type, K);
  const Format f = format_of(type);
  const bool all = ids.numel() == 0;
  const auto idx = all ? ids : ids.to(torch::kInt64).contiguous();
  const int64_t R = all ? blocks.size(0) : idx.numel(), N = blocks.size(0);
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  for (int64_t r = 0; !all && r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "gguf_dequantize: row ", ip[r], " out of range [0, ", N, ")");
  // `into`: a caller's buffer (a prefill's per-call dequantization reuses one instead of faulting in
  // fresh pages for every layer of every step).
  auto out = into.has_value() ? *into : torch::empty({R, K}, torch::TensorOptions().dtype(dtype));
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() == R * K,
              "gguf_dequantize: `into` must be a contiguous [rows, K] tensor of dtype");
  const bool f32 = dtype == torch::kFloat32;
  TORCH_CHECK(f32 || dtype == torch::kBFloat16 || dtype == torch::kHalf, "gguf_dequantize: fp32, bf16 or fp16 out");
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  float* o32 = f32 ? out.data_ptr<float>() : nullptr;
  auto* o16 = dtype == torch::kBFloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  auto* oh = dtype == torch::kHalf ? out.data_ptr<c10::Half>() : nullptr;
#pragma omp parallel for schedule(static) if (R * K >= 65536)
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) int8_t q[MAXB];
    alignas(64) float w[MAXB];
    float s[MAXS], m[MAXS];
    const uint8_t* row = bp + (all ? r : ip[r]) * row_bytes;
#ifdef SEGUE_GGUF_BF16
    if (o16 != nullptr) {
      gguf_bf16::dequantize_row(type, f, row, K, o16 + r * K);
      continue;
    }
#endif
    for (int64_t b = 0; b < K / f.block; ++b) {
      unpack(type, row + b * f.bytes, q, s, m);
      const int64_t at = r * K + b * f.block;
      expand(q, s, m, f.block, f.sub, f32 ? o32 + at : w);
      if (o16 != nullptr) {
#ifdef SEGUE_GGUF_BF16
        // Round to nearest even, as c10::BFloat16 does, 16 at a time: a prefill's per-call
        // dequantization of every layer is on its critical path.
        for (int64_t i = 0; i < f.block; i += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o16 + at + i),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(w + i))));
#else
        for (int64_t i = 0; i < f.block; ++i) o16[at + i] = c10::BFloat16(w[i]);
#endif
      } else if (oh != nullptr) {
        for (int64_t i = 0; i < f.block; ++i) oh[at + i] = c10::Half(w[i]);
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "x @ dequant(ggml blocks)^T over row segments of possibly different types "
        "(fp32 out for fp32 or fp16 x; bf16 x gets bf16 out unless fp32_out)",
        py::arg("x"), py::arg("segments"), py::arg("types"), py::arg("fp32_out") = false,
        // A server's event loop streams the last step's tokens while this one computes.
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize", &gguf_dequantize, "rows of ggml blocks dequantized (all rows when ids is empty)",
        py::arg("blocks"), py::arg("type"), py::arg("k"), py::arg("ids"), py::arg("dtype"),
        py::arg("into") = py::none(), py::call_guard<py::gil_scoped_release>());
}

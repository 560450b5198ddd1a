// Matmuls that read GGUF (ggml) block-quantized weights as the file stores them:
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.
//
// Decoding one sequence streams every weight byte once per token, so the step time is the file's
// bytes over memory bandwidth; expanding K-quants to bf16 at load time reads 3-4x the bytes. Every
// format here is w = s * q + m per sub-block of 16 or 32 weights, with small integers q and fp32
// s, m that are exact products of the file's fp16 and 6-bit factors (as gguf's own dequantize
// computes them), so the sums below are those of the dequantized weights up to fp32 rounding:
//   sum_k x_k w_k = sum_subblocks s * dot(x, q) + m * sum(x).
// Threads own slices of output channels. fp32 activations: gguf_fp32.h (any CPU). bf16
// activations on AVX512-BF16: gguf_dot.h and gguf_dot_formats.h, with the activations permuted
// once per call (gguf_bf16.h holds the code tables and a prefill's dequantization).
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// ggml_type ids.
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
                       // Not ggml types: Q4_0, Q4_1, Q8_0 and Q4_K repacked with 16 output rows
                       // interleaved (gguf_rows16.h): 1000 + the file's type.
                       Q4_0_ROWS16 = 1002, Q4_1_ROWS16 = 1003, Q8_0_ROWS16 = 1008, Q4_K_ROWS16 = 1012 };

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

}  // namespace
#include "gguf_fp32.h"
#include "gguf_bf16.h"
#include "gguf_dot.h"
#include "gguf_dot_formats.h"
#include "gguf_rows16.h"
#include "gguf_rows16_q8_0.h"
namespace {
#include "gguf_rows16_ops.h"

void check_segment(const torch::Tensor& blocks, int64_t t, int64_t K) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf kernels: blocks must be a contiguous [N, row_bytes] uint8 tensor");
  if (is_rows16(t)) {
    TORCH_CHECK(rows16_supported(), "gguf kernels: rows16 segments need a CPU with AVX512-BF16");
#ifdef SEGUE_GGUF_BF16
    const int64_t per_tile = t == Q4_K_ROWS16 ? 256 : 32;
    TORCH_CHECK(K % per_tile == 0 && blocks.size(1) == rows16_group_bytes(t, K),
                "gguf kernels: a rows16 group of K = ", K, " is not ", blocks.size(1), " bytes");
#endif
    return;
  }
  const Format f = format_of(t);
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
  // Work units: a row, or a group of 16 rows of a rows16 segment; threads take contiguous units of
  // about equal bytes (a fused projection's segments differ in bytes a row).
  std::vector<int64_t> unit_starts(S + 1, 0), byte_starts(S + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    check_segment(segments[i], types[i], K);
    TORCH_CHECK(!is_rows16(types[i]) || bf16, "gguf_linear: rows16 segments need bf16 activations");
    formats.push_back(is_rows16(types[i]) ? Format{32, 0, 32} : format_of(types[i]));
    bases.push_back(segments[i].data_ptr<uint8_t>());
    row_bytes.push_back(segments[i].size(1));
    starts[i + 1] = starts[i] + rows_of(segments[i], types[i]);
    unit_starts[i + 1] = unit_starts[i] + segments[i].size(0);
    byte_starts[i + 1] = byte_starts[i] + segments[i].numel();
  }
  const int64_t N = starts[S];
  // The first unit starting at or after byte b of the concatenated segments.
  const auto unit_at = [&](int64_t b) {
    int64_t i = 0;
    while (i < S && b >= byte_starts[i + 1]) ++i;
    if (i == S) return unit_starts[S];
    return unit_starts[i] + (b - byte_starts[i] + row_bytes[i] - 1) / row_bytes[i];
  };
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
    if (is_rows16(types[i])) continue;  // reads x as it is
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
#pragma omp parallel if (N * K >= 65536)
  {
  const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
  const int64_t u_end = unit_at(byte_starts[S] * (tid + 1) / threads);
  for (int64_t u = unit_at(byte_starts[S] * tid / threads); u < u_end; ++u) {
    int64_t seg = 0;
    while (u >= unit_starts[seg + 1]) ++seg;
    const uint8_t* row = bases[seg] + (u - unit_starts[seg]) * row_bytes[seg];
#ifdef SEGUE_GGUF_BF16
    if (is_rows16(types[seg])) {
      const int64_t n0 = starts[seg] + 16 * (u - unit_starts[seg]);
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min(MB, M - m0);
        float o[MB][gguf_rows16::ROWS];
        with_rows16(types[seg], [&](auto f) {
          rows16_dot<decltype(f)>(row, K, xb + m0 * K, xsum.data() + m0 * (K / 32), mb, o);
        });
        for (int64_t r = 0; r < mb; ++r)
          for (int i = 0; i < gguf_rows16::ROWS; ++i) {
            if (out_bf16) ob[(m0 + r) * N + n0 + i] = c10::BFloat16(o[r][i]);
            else op[(m0 + r) * N + n0 + i] = o[r][i];
          }
      }
      continue;
    }
#endif
    const int64_t n = starts[seg] + (u - unit_starts[seg]);
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
  }
  return out;
}

// Rows `ids` (all rows when empty) of a [N, row_bytes] block tensor, dequantized to `dtype`
// ([len(ids), K]): a prefill's dense weight one layer at a time, or embedding lookups.
torch::Tensor gguf_dequantize(torch::Tensor blocks, int64_t type, int64_t K, torch::Tensor ids, c10::ScalarType dtype,
                              c10::optional<torch::Tensor> into) {
  check_segment(blocks, type, K);
  const bool rows16 = is_rows16(type);
  const Format f = rows16 ? Format{32, 0, 32} : format_of(type);
  const bool all = ids.numel() == 0;
  const auto idx = all ? ids : ids.to(torch::kInt64).contiguous();
  const int64_t N = rows_of(blocks, type), R = all ? N : idx.numel();
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
#ifdef SEGUE_GGUF_BF16
  if (rows16) {
    TORCH_CHECK(o16 != nullptr, "gguf_dequantize: rows16 segments dequantize to bf16");
    if (all) {
#pragma omp parallel for schedule(static) if (R * K >= 65536)
      for (int64_t g = 0; g < N / 16; ++g)
        with_rows16(type, [&](auto fmt) { rows16_dequantize_group<decltype(fmt)>(bp + g * row_bytes, K, o16 + 16 * g * K); });
    } else {
#pragma omp parallel for schedule(static) if (R * K >= 65536)
      for (int64_t r = 0; r < R; ++r)
        with_rows16(type, [&](auto fmt) {
          rows16_dequantize_row<decltype(fmt)>(bp + ip[r] / 16 * row_bytes, K, static_cast<int>(ip[r] % 16), o16 + r * K);
        });
    }
    return out;
  }
#endif
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

// A [N, row bytes] Q4_0, Q4_1, Q8_0 or Q4_K segment (N % 16 == 0) repacked as [N / 16, group bytes]
// rows16 groups (type 1000 + its type).
torch::Tensor gguf_interleave_rows(torch::Tensor blocks, int64_t type, int64_t K) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K,
              "gguf_interleave_rows: Q4_0, Q4_1, Q8_0 or Q4_K, not type ", type);
  check_segment(blocks, type, K);
  TORCH_CHECK(rows16_supported(), "gguf_interleave_rows: rows16 needs a CPU with AVX512-BF16");
  const int64_t N = blocks.size(0);
  TORCH_CHECK(N % 16 == 0, "gguf_interleave_rows: ", N, " rows are not groups of 16");
#ifdef SEGUE_GGUF_BF16
  auto out = torch::empty({N / 16, rows16_group_bytes(type, K)}, blocks.options());
  rows16_pack(type, blocks.data_ptr<uint8_t>(), blocks.size(1), N, K, out.data_ptr<uint8_t>());
  return out;
#else
  return blocks;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_rows16_supported", &rows16_supported,
        "whether Q4_0, Q4_1, Q8_0 and Q4_K can be repacked and computed as rows16 groups");
  m.def("gguf_interleave_rows", &gguf_interleave_rows,
        "a Q4_0, Q4_1, Q8_0 or Q4_K segment repacked as rows16 groups (type 1000 + its type)",
        py::arg("blocks"), py::arg("type"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_linear", &gguf_linear, "x @ dequant(ggml blocks)^T over row segments of possibly different types "
        "(fp32 out for fp32 or fp16 x; bf16 x gets bf16 out unless fp32_out)",
        py::arg("x"), py::arg("segments"), py::arg("types"), py::arg("fp32_out") = false,
        // A server's event loop streams the last step's tokens while this one computes.
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize", &gguf_dequantize, "rows of ggml blocks dequantized (all rows when ids is empty)",
        py::arg("blocks"), py::arg("type"), py::arg("k"), py::arg("ids"), py::arg("dtype"),
        py::arg("into") = py::none(), py::call_guard<py::gil_scoped_release>());
}

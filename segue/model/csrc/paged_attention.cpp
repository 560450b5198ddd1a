// Decode attention over the paged KV cache for CPUs: each (sequence, KV head) pair reads its
// K and V blocks exactly once and serves all the query heads of its group, so GQA costs no
// repeated K/V and no gathered copy. fp32, bf16 and fp16 caches; scores, softmax and the output
// accumulate in fp32 whatever the storage type.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

// One (sequence, KV head) pair. DIM > 0 fixes the head size at compile time so the dot
// products fully unroll into vector FMAs; DIM == 0 is the generic fallback.
template <typename T, int64_t DIM>
static void attend_one(const float* qs, const T* kp, const T* vp, const int64_t* table,
                       int64_t ctx, int64_t h, int64_t group, int64_t dim_rt, int64_t num_blocks,
                       int64_t block_size, float scale, float* acc_out, std::vector<float>& scores,
                       std::vector<float>& row_f) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  scores.assign(group * ctx, 0.f);
  row_f.resize(dim);
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const T* kr = kp + ((h * num_blocks + table[pos / block_size]) * block_size + pos % block_size) * dim;
    const float* kf;
    if constexpr (std::is_same_v<T, float>) {
      kf = kr;
    } else {
      for (int64_t d = 0; d < dim; ++d) row_f[d] = static_cast<float>(kr[d]);
      kf = row_f.data();
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qr = qs + g * dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < dim; ++d) acc += qr[d] * kf[d];
      scores[g * ctx + pos] = acc * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * ctx;
    const float mx = *std::max_element(row, row + ctx);
    float sum = 0.f;
    for (int64_t pos = 0; pos < ctx; ++pos) {
      row[pos] = std::exp(row[pos] - mx);
      sum += row[pos];
    }
    const float inv = 1.f / sum;
    for (int64_t pos = 0; pos < ctx; ++pos) row[pos] *= inv;
  }
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const T* vr = vp + ((h * num_blocks + table[pos / block_size]) * block_size + pos % block_size) * dim;
    const float* vf;
    if constexpr (std::is_same_v<T, float>) {
      vf = vr;
    } else {
      for (int64_t d = 0; d < dim; ++d) row_f[d] = static_cast<float>(vr[d]);
      vf = row_f.data();
    }
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + pos];
      float* orow = acc_out + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * vf[d];
    }
  }
}

template <typename T>
static void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens, float scale, torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  // Plain OpenMP rather than at::parallel_for: the latter runs serially in extensions built
  // without torch's own OpenMP setup (measured: no speedup from a second thread).
#pragma omp parallel if (n * kv_heads > 1)
  {
    std::vector<float> scores, row_f, qf(group * dim), acc(group * dim);
#pragma omp for schedule(dynamic, 4)
    for (int64_t idx = 0; idx < n * kv_heads; ++idx) {
      const int64_t s = idx / kv_heads, h = idx % kv_heads;
      const T* qs = qp + (s * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<float>(qs[i]);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t* table = bt + s * max_blocks;
      if (dim == 64)
        attend_one<T, 64>(qf.data(), kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, scale, acc.data(), scores, row_f);
      else if (dim == 128)
        attend_one<T, 128>(qf.data(), kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, scale, acc.data(), scores, row_f);
      else
        attend_one<T, 0>(qf.data(), kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, scale, acc.data(), scores, row_f);
      T* os = op + (s * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) os[i] = static_cast<T>(acc[i]);
    }
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [n, heads, dim]
                                     torch::Tensor k_cache,       // [kv_heads, blocks, block_size, dim]
                                     torch::Tensor v_cache,
                                     torch::Tensor block_tables,  // [n, max_blocks] int64
                                     torch::Tensor context_lens,  // [n] int64
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, context_lens,
                                    static_cast<float>(scale), out);
  });
  return out;
}

// Defined in fused_ops.cpp.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
void rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                    int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
// Defined in quant_ops.cpp.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_lo);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU; fp32 accumulation)");
  m.def("add_rms_norm", &add_rms_norm, "h += delta (in place); returns rms_norm(h) * weight");
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of Q and K in place, K/V written to the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up]");
  m.def("int8_linear", &int8_linear, "x @ (q * scale)^T, int8 weights per output channel");
  m.def("int4_linear", &int4_linear, "x @ dequant(int4 groups of 32)^T");
}

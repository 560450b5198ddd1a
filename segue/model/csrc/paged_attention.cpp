// Decode attention over the paged KV cache for CPUs: each (sequence, KV head) pair reads its
// K and V blocks exactly once and serves all the query heads of its group, so GQA costs no
// repeated K/V and no gathered copy. fp32 only; the Python side falls back to torch otherwise.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

// One (sequence, KV head) pair. DIM > 0 fixes the head size at compile time so the dot
// products fully unroll into vector FMAs; DIM == 0 is the generic fallback.
template <int64_t DIM>
static void attend_one(const float* qs, const float* kp, const float* vp, const int64_t* table,
                       int64_t ctx, int64_t h, int64_t group, int64_t dim_rt, int64_t num_blocks,
                       int64_t block_size, float scale, float* os, std::vector<float>& scores) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  scores.assign(group * ctx, 0.f);
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const float* kr = kp + ((h * num_blocks + table[pos / block_size]) * block_size + pos % block_size) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qr = qs + g * dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < dim; ++d) acc += qr[d] * kr[d];
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
    const float* vr = vp + ((h * num_blocks + table[pos / block_size]) * block_size + pos % block_size) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + pos];
      float* orow = os + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * vr[d];
    }
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [n, heads, dim]
                                     torch::Tensor k_cache,       // [kv_heads, blocks, block_size, dim]
                                     torch::Tensor v_cache,
                                     torch::Tensor block_tables,  // [n, max_blocks] int64
                                     torch::Tensor context_lens,  // [n] int64
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: fp32 only");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Plain OpenMP rather than at::parallel_for: the latter runs serially in extensions built
  // without torch's own OpenMP setup (measured: no speedup from a second thread).
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 4)
    for (int64_t idx = 0; idx < n * kv_heads; ++idx) {
      const int64_t s = idx / kv_heads, h = idx % kv_heads;
      const float* qs = qp + (s * heads + h * group) * dim;
      float* os = op + (s * heads + h * group) * dim;
      const int64_t* table = bt + s * max_blocks;
      if (dim == 64)
        attend_one<64>(qs, kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, fscale, os, scores);
      else if (dim == 128)
        attend_one<128>(qs, kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, fscale, os, scores);
      else
        attend_one<0>(qs, kp, vp, table, cl[s], h, group, dim, num_blocks, block_size, fscale, os, scores);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, fp32)");
}

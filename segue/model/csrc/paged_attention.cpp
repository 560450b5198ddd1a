// Decode attention over the paged KV cache for CPUs: each (sequence, KV head) pair reads its
// K and V blocks exactly once and serves all the query heads of its group, so GQA costs no
// repeated K/V and no gathered copy. fp32, bf16 and fp16 caches; scores, softmax and the output
// accumulate in fp32 whatever the storage type.
#include <torch/extension.h>
#include <omp.h>
#include "avx2_common.h"
#include "decode_attention_avx2.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

// One (sequence, KV head) pair over the positions of table entries order[o0, o1): for each query
// head g of the group, mx[g] and sum[g] of its scores' softmax (max, and sum of e^(score - max))
// and acc_out[g] = sum_pos e^(score - max) v_pos, not yet divided by sum (a partition of a long
// context is merged with the others first). DIM > 0 fixes the head size at compile time so the
// dot products fully unroll into vector FMAs; DIM == 0 is the generic fallback.
template <typename T, int64_t DIM>
static void attend_one(const float* qs, const T* kp, const T* vp, const int64_t* table, const std::vector<int64_t>& order,
                       size_t o0, size_t o1, int64_t ctx, int64_t h, int64_t group, int64_t dim_rt, int64_t num_blocks,
                       int64_t block_size, float scale, float* acc_out, float* mx, float* sum,
                       std::vector<float>& scores, std::vector<float>& row_f) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt, rows = rows_in(order, o0, o1, ctx, block_size);
  scores.assign(group * rows, 0.f);
  row_f.resize(dim);
  // fn(row of the cache, visit index) over the range's rows of head h in `cache`.
  auto each_row = [&](const T* cache, auto&& fn) {
    int64_t i = 0;
    for (size_t oi = o0; oi < o1; ++oi) {
      const int64_t b = order[oi], n = std::min(block_size, ctx - b * block_size);
      for (int64_t j = 0; j < n; ++j, ++i) fn(cache + ((h * num_blocks + table[b]) * block_size + j) * dim, i);
    }
  };
  auto as_float = [&](const T* r) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return r;
    } else {
      for (int64_t d = 0; d < dim; ++d) row_f[d] = static_cast<float>(r[d]);
      return row_f.data();
    }
  };
  each_row(kp, [&](const T* kr, int64_t i) {
    const float* kf = as_float(kr);
    for (int64_t g = 0; g < group; ++g) {
      const float* qr = qs + g * dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < dim; ++d) acc += qr[d] * kf[d];
      scores[g * rows + i] = acc * scale;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * rows;
    mx[g] = rows ? *std::max_element(row, row + rows) : kNoScore;
    sum[g] = 0.f;
    for (int64_t i = 0; i < rows; ++i) {
      row[i] = std::exp(row[i] - mx[g]);
      sum[g] += row[i];
    }
  }
  each_row(vp, [&](const T* vr, int64_t i) {
    const float* vf = as_float(vr);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * rows + i];
      float* orow = acc_out + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * vf[d];
    }
  });
}


// The indices of a sequence's first ctx / block_size table entries in the order for_each_row
// visits them: sorted by block id, or in the table's (logical) order when `logical`. P.V is summed
// in visiting order, so sorted ids make the output's last bits depend on where the pool put the
// blocks; batch-invariant runs ask for the logical order. Shared by the sequence's KV heads.
static std::vector<int64_t> block_order(const int64_t* table, int64_t ctx, int64_t block_size, bool logical) {
  std::vector<int64_t> order((ctx + block_size - 1) / block_size);
  for (int64_t b = 0; b < static_cast<int64_t>(order.size()); ++b) order[b] = b;
  if (!logical)
    std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return table[x] < table[y]; });
  return order;
}

// T: the queries' and output's dtype; C: the cache's (bf16 under fp32 queries halves the bytes read).
template <typename T, typename C>
static void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& context_lens, float scale, bool logical_order,
                                  torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  // Once per sequence, not per (sequence, KV head) item.
  std::vector<std::vector<int64_t>> orders(n);
  for (int64_t s = 0; s < n; ++s) orders[s] = block_order(bt + s * max_blocks, cl[s], block_size, logical_order);
  // Fewer (sequence, KV head) items than two per thread (one agent decoding alone has 2-8) leave
  // threads idle for the whole call: each item's blocks are then split into `parts` and the
  // partial softmaxes merged, at least a block a part. Not in batch-invariant runs, where a
  // sequence's sums must not depend on what else is in the batch.
  const int64_t items = n * kv_heads, threads = omp_get_max_threads();
  int64_t parts = 1;
  if (!logical_order && n > 0 && items < 2 * threads) {
    const int64_t longest = *std::max_element(cl, cl + n);
    parts = std::min((2 * threads + items - 1) / items, (longest + block_size - 1) / block_size);
  }
  std::vector<float> part_acc(parts > 1 ? items * parts * group * dim : 0);
  std::vector<float> part_mx(parts > 1 ? items * parts * group : 0), part_sum(part_mx.size());
  // Plain OpenMP rather than at::parallel_for: the latter runs serially in extensions built
  // without torch's own OpenMP setup (measured: no speedup from a second thread).
#pragma omp parallel if (items * parts > 1)
  {
    std::vector<float> scores, row_f, qf(group * dim), acc(group * dim), mx(group), sum(group);
    // One item at a time: a single sequence has as few items as KV heads times parts.
#pragma omp for schedule(dynamic, 1)
    for (int64_t idx = 0; idx < items * parts; ++idx) {
      const int64_t item = idx / parts, part = idx % parts, s = item / kv_heads, h = item % kv_heads;
      const size_t nb = orders[s].size(), o0 = nb * part / parts, o1 = nb * (part + 1) / parts;
      const T* qs = qp + (s * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<float>(qs[i]);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t* table = bt + s * max_blocks;
      bool done = false;
#ifdef __AVX2__
      if constexpr (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>) {
        if (dim == 64 || dim == 128) {
          (dim == 64 ? avx2::attend<64, C> : avx2::attend<128, C>)(
              qf.data(), kp, vp, table, orders[s], o0, o1, cl[s], h, group, num_blocks, block_size, scale, acc.data(),
              mx.data(), sum.data(), scores);
          done = true;
        }
      }
#endif
      if (!done && dim == 64)
        attend_one<C, 64>(qf.data(), kp, vp, table, orders[s], o0, o1, cl[s], h, group, dim, num_blocks, block_size,
                          scale, acc.data(), mx.data(), sum.data(), scores, row_f);
      else if (!done && dim == 128)
        attend_one<C, 128>(qf.data(), kp, vp, table, orders[s], o0, o1, cl[s], h, group, dim, num_blocks, block_size,
                           scale, acc.data(), mx.data(), sum.data(), scores, row_f);
      else if (!done)
        attend_one<C, 0>(qf.data(), kp, vp, table, orders[s], o0, o1, cl[s], h, group, dim, num_blocks, block_size,
                         scale, acc.data(), mx.data(), sum.data(), scores, row_f);
      if (parts == 1) {
        T* os = op + (s * heads + h * group) * dim;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d) os[g * dim + d] = static_cast<T>(acc[g * dim + d] / sum[g]);
        continue;
      }
      std::copy(acc.begin(), acc.end(), part_acc.begin() + idx * group * dim);
      std::copy(mx.begin(), mx.end(), part_mx.begin() + idx * group);
      std::copy(sum.begin(), sum.end(), part_sum.begin() + idx * group);
    }
    // The parts of an item, merged (after the loop's barrier): rescaled to their common max.
    if (parts > 1) {
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t s = item / kv_heads, h = item % kv_heads;
        T* os = op + (s * heads + h * group) * dim;
        for (int64_t g = 0; g < group; ++g) {
          float top = kNoScore, total = 0.f;
          for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_mx[(item * parts + p) * group + g]);
          std::fill(acc.begin(), acc.begin() + dim, 0.f);
          for (int64_t p = 0; p < parts; ++p) {
            const int64_t at = (item * parts + p) * group + g;
            if (part_sum[at] == 0.f) continue;  // an empty part (fewer blocks than parts)
            const float w = std::exp(part_mx[at] - top);
            total += w * part_sum[at];
            const float* pa = part_acc.data() + at * dim;
            for (int64_t d = 0; d < dim; ++d) acc[d] += w * pa[d];
          }
          for (int64_t d = 0; d < dim; ++d) os[g * dim + d] = static_cast<T>(acc[d] / total);
        }
      }
    }
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [n, heads, dim]
                                     torch::Tensor k_cache,       // [kv_heads, blocks, block_size, dim]
                                     torch::Tensor v_cache,
                                     torch::Tensor block_tables,  // [n, max_blocks] int64
                                     torch::Tensor context_lens,  // [n] int64
                                     double scale,
                                     bool logical_order) {        // sum over positions in order (bitwise reproducible)
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode_attention: K and V caches differ in dtype");
  const bool bf16_cache = q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16_cache || q.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: the cache must have q's dtype (or bf16 under fp32)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(q.size(1) / k_cache.size(0) <= 16, "paged_decode_attention: more than 16 query heads per KV head");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [n, heads, dim] and the caches [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "paged_decode_attention: q's head size ", q.size(2),
              " differs from the cache's ", k_cache.size(3));
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode_attention: query heads not a multiple of KV heads");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "paged_decode_attention: one block table row and one context length per query");
  // A wrong call must raise, not read outside the cache: every block a sequence reads is checked.
  {
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* cl = context_lens.data_ptr<int64_t>();
    const int64_t max_blocks = block_tables.size(1), bs = k_cache.size(2), nb = k_cache.size(1);
    for (int64_t s = 0; s < q.size(0); ++s) {
      TORCH_CHECK(cl[s] >= 1, "paged_decode_attention: context length ", cl[s], " (a query attends to at least itself)");
      const int64_t blocks = (cl[s] + bs - 1) / bs;
      TORCH_CHECK(blocks <= max_blocks, "paged_decode_attention: context of ", cl[s], " tokens needs ", blocks,
                  " blocks, the table has ", max_blocks);
      for (int64_t b = 0; b < blocks; ++b)
        TORCH_CHECK(bt[s * max_blocks + b] >= 0 && bt[s * max_blocks + b] < nb,
                    "paged_decode_attention: block id ", bt[s * max_blocks + b], " outside the cache");
    }
  }
  auto out = torch::empty_like(q);
  if (bf16_cache) {
    decode_attention_impl<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens,
                                                static_cast<float>(scale), logical_order, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t, scalar_t>(q, k_cache, v_cache, block_tables, context_lens,
                                              static_cast<float>(scale), logical_order, out);
  });
  return out;
}

// Defined in fused_ops.cpp.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
void rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                    int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
// Defined in prefill_attention.cpp.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor query_start, torch::Tensor start_pos,
                                      torch::Tensor block_tables, double scale);
bool paged_prefill_supports(at::ScalarType q_dtype, at::ScalarType cache_dtype, int64_t head_dim, int64_t group);
// Defined in quant_ops.cpp.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_lo);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU; fp32 accumulation)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("logical_order") = false);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of prefill chunks over the paged cache (CPU; tiled online softmax)");
  m.def("paged_prefill_supports", &paged_prefill_supports,
        "Whether paged_prefill_attention takes these dtypes, head size and query heads per KV head",
        py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("head_dim"), py::arg("group"));
  m.def("add_rms_norm", &add_rms_norm, "h += delta (in place); returns rms_norm(h) * weight");
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of Q and K in place, K/V written to the cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up]");
  m.def("int8_linear", &int8_linear, "x @ (q * scale)^T, int8 weights in groups of 32 along K");
  m.def("int4_linear", &int4_linear, "x @ dequant(int4 groups of 32)^T");
}

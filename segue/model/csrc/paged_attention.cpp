// Decode attention over the paged KV cache for CPUs: each (sequence, KV head) pair reads its
// K and V blocks exactly once and serves all the query heads of its group, so GQA costs no
// repeated K/V and no gathered copy. fp32, bf16 and fp16 caches; scores, softmax and the output
// accumulate in fp32 whatever the storage type.
#include <torch/extension.h>
#include <omp.h>
#include "avx2_common.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

// The max of no scores (an empty part); finite, since the kernels build with -ffast-math.
constexpr float kNoScore = -3.0e38f;

// Rows of a sequence's first ctx positions held by table entries order[o0, o1).
static int64_t rows_in(const std::vector<int64_t>& order, size_t o0, size_t o1, int64_t ctx, int64_t block_size) {
  int64_t rows = 0;
  for (size_t oi = o0; oi < o1; ++oi) rows += std::min(block_size, ctx - order[oi] * block_size);
  return rows;
}

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

#ifdef __AVX2__
// The AVX2 path for 64- and 128-wide heads (fp32 or bf16 cache): at batch 64 a decode step reads every
// sequence's K and V once per layer, so this kernel should run at memory bandwidth. The generic
// loop above ran at a third of it (scalar softmax, a horizontal reduction per score, the output
// row reloaded for every position).
namespace avx2 {

// e^x for x <= 0 (scores minus their max): Cephes' range reduction and degree-5 polynomial,
// relative error ~2e-7, i.e. fp32 rounding.
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// A DIM-wide row as DIM / 8 fp32 registers.
template <int DIM>
inline void load_row(const float* p, __m256* r) {
  for (int i = 0; i < DIM / 8; ++i) r[i] = _mm256_loadu_ps(p + 8 * i);
}
template <int DIM>
inline void load_row(const c10::BFloat16* p, __m256* r) {  // bf16 is the top half of an fp32
  const auto* u = reinterpret_cast<const __m128i*>(p);
  for (int i = 0; i < DIM / 8; ++i)
    r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(u + i)), 16));
}

// Calls fn(row, visit index) for each of a sequence's cached DIM-wide rows of one head held by
// table entries order[o0, o1). Blocks
// are visited in the order of their ids (`order`: the table's indices sorted by block id), not
// the table's (unless asked, see block_order): attention does not depend on the order positions
// are visited in, beyond the last bits of its sums, and the CPU's
// prefetchers stream memory read in ascending order only. A busy pool evicts a finished table
// tail first, so the blocks it hands the next sequence often run backwards: 4 sequences x 2,000
// tokens, 30 layers, read in table order took 20 ms over reversed or pairwise-swapped consecutive
// blocks against 7.6 ms in order; in id order all three take 8 ms.
// Blocks whose ids are not consecutive still start a new stream each, which the hardware
// prefetchers pick up only after a few misses: runs of 8 consecutive blocks took 16.7 ms and a
// shuffled table 28 ms. So each row also prefetches the matching row kPrefetchBlocks blocks
// ahead in visiting order, spread over the block rather than in one burst (a burst at the block's
// start helped a shuffled table only): 10 ms and 13 ms, consecutive blocks unchanged (measured
// on an AMD EPYC with avx512_bf16; 2, 4 and 8 blocks ahead were within 5 % of each other).
constexpr size_t kPrefetchBlocks = 4;
template <int DIM, typename T, typename Fn>
inline void for_each_row(const T* cache, const int64_t* table, const std::vector<int64_t>& order, size_t o0,
                         size_t o1, int64_t ctx, int64_t head_base, int64_t block_size, Fn&& fn) {
  int64_t visit = 0;  // fn gets (row, its index in visiting order)
  for (size_t oi = o0; oi < o1; ++oi) {
    const int64_t b = order[oi];
    const int64_t pos0 = b * block_size;
    const T* block = cache + head_base + table[b] * block_size * DIM;
    const int64_t n = std::min(block_size, ctx - pos0);
    const char* ahead = oi + kPrefetchBlocks < o1
        ? reinterpret_cast<const char*>(cache + head_base + table[order[oi + kPrefetchBlocks]] * block_size * DIM) : nullptr;
    for (int64_t i = 0; i < n; ++i, ++visit) {
      if (ahead != nullptr)
        for (size_t off = 0; off < DIM * sizeof(T); off += 64) _mm_prefetch(ahead + i * DIM * sizeof(T) + off, _MM_HINT_T0);
      fn(block + i * DIM, visit);
    }
  }
}

// Same contract as attend_one<T, DIM>, for DIM of 64 or 128 (8 or 16 registers a row).
template <int DIM, typename T>
void attend(const float* qs, const T* kp, const T* vp, const int64_t* table, const std::vector<int64_t>& order,
              size_t o0, size_t o1, int64_t ctx, int64_t h, int64_t group, int64_t num_blocks, int64_t block_size,
              float scale, float* acc_out, float* mx, float* sum, std::vector<float>& scores) {
  const int64_t rows = rows_in(order, o0, o1, ctx, block_size);
  scores.resize(group * rows);
  constexpr int W = DIM / 8;
  const int64_t head_base = h * num_blocks * block_size * DIM;
  for_each_row<DIM>(kp, table, order, o0, o1, ctx, head_base, block_size, [&](const T* kr, int64_t i) {
    __m256 k[W];
    load_row<DIM>(kr, k);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qs + g * DIM;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]);
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(q + 8), k[1]);
      for (int j = 2; j < W; j += 2) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), k[j], a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j + 8), k[j + 1], b);
      }
      scores[g * rows + i] = hsum(_mm256_add_ps(a, b)) * scale;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * rows;
    mx[g] = rows ? *std::max_element(s, s + rows) : kNoScore;
    const __m256 vmx = _mm256_set1_ps(mx[g]);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= rows; i += 8) {
      const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
      _mm256_storeu_ps(s + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    sum[g] = hsum(vsum);
    for (; i < rows; ++i) sum[g] += (s[i] = std::exp(s[i] - mx[g]));
  }
  for (int64_t g = 0; g < group; ++g) {
    __m256 acc[W];
    for (int j = 0; j < W; ++j) acc[j] = _mm256_setzero_ps();
    const float* s = scores.data() + g * rows;
    for_each_row<DIM>(vp, table, order, o0, o1, ctx, head_base, block_size, [&](const T* vr, int64_t i) {
      __m256 v[W];
      load_row<DIM>(vr, v);
      const __m256 p = _mm256_set1_ps(s[i]);
      for (int j = 0; j < W; ++j) acc[j] = _mm256_fmadd_ps(p, v[j], acc[j]);
    });
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc_out + g * DIM + 8 * j, acc[j]);
  }
}

}  // namespace avx2
#endif

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

// Fewest positions worth a part of their own (a part costs a merge of group x dim floats).
constexpr int64_t kMinPartRows = 256;

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
  // partial softmaxes merged. Not in batch-invariant runs, where a sequence's sums must not depend
  // on what else is in the batch, nor below kMinPartRows positions a part.
  const int64_t items = n * kv_heads, threads = omp_get_max_threads();
  int64_t parts = 1;
  if (!logical_order && n > 0 && items < 2 * threads) {
    const int64_t longest = *std::max_element(cl, cl + n);
    parts = std::max<int64_t>(1, std::min((2 * threads + items - 1) / items, longest / kMinPartRows));
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

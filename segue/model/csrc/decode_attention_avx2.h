// The vectorized decode attention of one (sequence, KV head) pair for 64- and 128-wide heads
// (AVX2; included by paged_attention.cpp), and the helpers both paths share.
#pragma once
#include <torch/extension.h>
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
inline int64_t rows_in(const std::vector<int64_t>& order, size_t o0, size_t o1, int64_t ctx, int64_t block_size) {
  int64_t rows = 0;
  for (size_t oi = o0; oi < o1; ++oi) rows += std::min(block_size, ctx - order[oi] * block_size);
  return rows;
}

#ifdef __AVX2__
// The AVX2 path for 64- and 128-wide heads (fp32 or bf16 cache): at batch 64 a decode step reads every
// sequence's K and V once per layer, so this kernel should run at memory bandwidth. The generic
// loop (attend_one in paged_attention.cpp) ran at a third of it (scalar softmax, a horizontal reduction per score, the output
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

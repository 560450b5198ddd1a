// Fused elementwise steps of the decoder layer for CPUs. A 135M model's decode step is mostly
// per-op dispatch: the torch forms of RMSNorm (+ residual), rotary embedding + KV write and
// SiLU-gating are 6-10 small ops each; here each is one pass over the rows, in fp32 whatever
// the storage dtype (fp32, bf16, fp16).
#include <torch/extension.h>
#include <omp.h>

#include <cmath>

template <typename T>
static void add_rms_norm_impl(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows >= 8)
  for (int64_t r = 0; r < rows; ++r) {
    T* hr = h + r * dim;
    float ss = 0.f;
    if (delta != nullptr) {
      const T* dr = delta + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T sum = static_cast<T>(static_cast<float>(hr[d]) + static_cast<float>(dr[d]));
        hr[d] = sum;
        const float f = static_cast<float>(sum);
        ss += f * f;
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) {
        const float f = static_cast<float>(hr[d]);
        ss += f * f;
      }
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* orow = out + r * dim;
    for (int64_t d = 0; d < dim; ++d)
      orow[d] = static_cast<T>(static_cast<float>(w[d]) * (static_cast<float>(hr[d]) * inv));
  }
}

torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2, "add_rms_norm: h must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type(), "add_rms_norm: weight dtype must match h");
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == h.scalar_type(), "add_rms_norm: delta must match h");
  }
  weight = weight.contiguous();
  auto out = torch::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(h.data_ptr<scalar_t>(), d.defined() ? d.data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), h.size(0), h.size(1),
                                static_cast<float>(eps));
  });
  return out;
}

template <typename T>
static inline void rotate_half(T* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
    x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
  }
}

// T: the activations' dtype; C: the cache's (bf16 under an fp32 model halves the bytes that every
// decode step's attention reads).
template <typename T, typename C>
static void rope_and_cache_impl(T* qkv, const int64_t* pos, const float* cos, const float* sin, C* kc, C* vc,
                                const int64_t* slots, int64_t rows, int64_t nh, int64_t kvh, int64_t hd,
                                int64_t cache_slots) {
  const int64_t half = hd / 2, width = (nh + 2 * kvh) * hd;
#pragma omp parallel for if (rows >= 8)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkv + r * width;
    const float* c = cos + pos[r] * half;
    const float* s = sin + pos[r] * half;
    for (int64_t h = 0; h < nh + kvh; ++h) rotate_half(row + h * hd, c, s, half);
    const int64_t slot = slots[r];
    const T* k = row + nh * hd;
    const T* v = k + kvh * hd;
    for (int64_t h = 0; h < kvh; ++h) {
      C* kd = kc + (h * cache_slots + slot) * hd;
      C* vd = vc + (h * cache_slots + slot) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        kd[d] = static_cast<C>(k[h * hd + d]);
        vd[d] = static_cast<C>(v[h * hd + d]);
      }
    }
  }
}

void rope_and_cache(torch::Tensor qkv,           // [T, (heads + 2 * kv_heads) * dim], rotated in place
                    torch::Tensor positions,     // [T] int64
                    torch::Tensor cos,           // [max_pos, dim / 2] fp32
                    torch::Tensor sin,
                    torch::Tensor k_cache,       // [kv_heads, blocks, block_size, dim] (one layer)
                    torch::Tensor v_cache,
                    torch::Tensor slot_mapping,  // [T] int64
                    int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rope_and_cache: qkv and the cache must be contiguous");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous(), "rope_and_cache: cos/sin must be contiguous fp32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "rope_and_cache: K and V caches differ in dtype");
  const bool bf16_cache = qkv.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16_cache || qkv.scalar_type() == k_cache.scalar_type(),
              "rope_and_cache: the cache must have qkv's dtype (or bf16 under fp32)");
  const int64_t hd = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * hd && cos.size(1) * 2 == hd,
              "rope_and_cache: shapes do not match the head layout");
  positions = positions.to(torch::kInt64).contiguous();
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == num_kv_heads && v_cache.sizes() == k_cache.sizes(),
              "rope_and_cache: the caches must be [kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "rope_and_cache: one position and one slot per row");
  // A wrong call must raise, not read past the RoPE table or write outside the cache.
  {
    const int64_t* p = positions.data_ptr<int64_t>();
    const int64_t* sl = slot_mapping.data_ptr<int64_t>();
    for (int64_t r = 0; r < qkv.size(0); ++r) {
      TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "rope_and_cache: position ", p[r], " outside the RoPE table of ",
                  cos.size(0));
      TORCH_CHECK(sl[r] >= 0 && sl[r] < cache_slots, "rope_and_cache: slot ", sl[r], " outside the cache of ",
                  cache_slots, " slots");
    }
  }
  if (bf16_cache) {
    rope_and_cache_impl<float, c10::BFloat16>(
        qkv.data_ptr<float>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
        k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), slot_mapping.data_ptr<int64_t>(),
        qkv.size(0), num_heads, num_kv_heads, hd, cache_slots);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache", [&] {
    rope_and_cache_impl<scalar_t, scalar_t>(qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                            sin.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                            slot_mapping.data_ptr<int64_t>(), qkv.size(0), num_heads, num_kv_heads, hd,
                                            cache_slots);
  });
}

template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows >= 8)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = static_cast<float>(g[i]);
      o[i] = static_cast<T>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
    }
  }
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: expected [rows, 2 * inter]");
  gate_up = gate_up.contiguous();
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

// The rows16 formats (gguf_rows16.h, gguf_rows16_q8_0.h) by type id, for gguf_ops.cpp's entry
// points: which types are rows16, a group's bytes, the kernels per format and row count, packing
// (included inside gguf_ops.cpp's anonymous namespace, after the format headers).
#pragma once

bool rows16_supported() {
#ifdef SEGUE_GGUF_BF16
  return true;
#else
  return false;
#endif
}

bool is_rows16(int64_t t) { return t == Q4_0_ROWS16 || t == Q4_1_ROWS16 || t == Q8_0_ROWS16 || t == Q4_K_ROWS16; }

// Output rows of a segment: a rows16 segment is [N / 16, bytes of a group].
int64_t rows_of(const torch::Tensor& blocks, int64_t t) { return is_rows16(t) ? 16 * blocks.size(0) : blocks.size(0); }

#ifdef SEGUE_GGUF_BF16
// fn(F{}) for the rows16 format F of type t (or of the file type it repacks).
template <typename Fn>
auto with_rows16(int64_t t, Fn fn) {
  switch (t) {
    case Q4_K_ROWS16: case Q4_K: return fn(gguf_rows16::Q4K{});
    case Q4_0_ROWS16: case Q4_0: return fn(gguf_rows16::Legacy<false>{});
    case Q8_0_ROWS16: case Q8_0: return fn(gguf_rows16::Q8{});
    default: return fn(gguf_rows16::Legacy<true>{});
  }
}

// Bytes of a rows16 group of K weights a row.
int64_t rows16_group_bytes(int64_t t, int64_t K) {
  return with_rows16(t, [&](auto f) { using F = decltype(f); return K / (32 * F::SUBS) * F::TILE; });
}

// Q8_0 has its own kernels (two nibble planes); the 4-bit formats share gguf_rows16's.
template <typename F, int R>
void rows16_dot_r(const uint8_t* tiles, int64_t K, const uint16_t* x, const float* xsum, float (*out)[gguf_rows16::ROWS]) {
  if constexpr (std::is_same_v<F, gguf_rows16::Q8>) F::template dot<R>(tiles, K, x, xsum, out);
  else gguf_rows16::dot<F, R>(tiles, K, x, xsum, out);
}
template <typename F>
void rows16_dequantize_row(const uint8_t* tiles, int64_t K, int i, c10::BFloat16* out) {
  if constexpr (std::is_same_v<F, gguf_rows16::Q8>) F::dequantize_row(tiles, K, i, out);
  else gguf_rows16::dequantize_row<F>(tiles, K, i, out);
}
template <typename F>
void rows16_dequantize_group(const uint8_t* tiles, int64_t K, c10::BFloat16* out) {
  if constexpr (std::is_same_v<F, gguf_rows16::Q8>) F::dequantize_group(tiles, K, out);
  else gguf_rows16::dequantize_group<F>(tiles, K, out);
}

// Rows [0, mb) of x (mb <= 8) against one rows16 group's tiles of format F.
template <typename F>
void rows16_dot(const uint8_t* tiles, int64_t K, const uint16_t* x, const float* xsum, int64_t mb,
                float (*out)[gguf_rows16::ROWS]) {
  switch (mb) {
    case 1: return rows16_dot_r<F, 1>(tiles, K, x, xsum, out);
    case 2: return rows16_dot_r<F, 2>(tiles, K, x, xsum, out);
    case 3: return rows16_dot_r<F, 3>(tiles, K, x, xsum, out);
    case 4: return rows16_dot_r<F, 4>(tiles, K, x, xsum, out);
    case 5: return rows16_dot_r<F, 5>(tiles, K, x, xsum, out);
    case 6: return rows16_dot_r<F, 6>(tiles, K, x, xsum, out);
    case 7: return rows16_dot_r<F, 7>(tiles, K, x, xsum, out);
    default: return rows16_dot_r<F, 8>(tiles, K, x, xsum, out);
  }
}
#endif

#ifdef SEGUE_GGUF_BF16
// A [N, row_bytes] segment of file type t (N % 16 == 0) packed into out, [N / 16, group bytes].
inline void rows16_pack(int64_t t, const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out) {
  const int64_t group_bytes = rows16_group_bytes(t, K);
  with_rows16(t, [&](auto fmt) {
    using F = decltype(fmt);
    const int64_t tiles = K / (32 * F::SUBS);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 16; ++g)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint8_t* rows[16];
        for (int i = 0; i < 16; ++i) rows[i] = blocks + (16 * g + i) * row_bytes + tile * F::FILE_BYTES;
        F::pack_tile(rows, out + g * group_bytes + tile * F::TILE);
      }
  });
}
#endif

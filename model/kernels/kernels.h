// Declarations shared by attention.cpp and layers.cpp (model/kernels).
#pragma once

// ATen only (not torch/extension.h: pybind11 and the C++ frontend double a build's time);
// layers.cpp adds the bindings.
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

// bfloat16 -> float32 (exact: the top 16 bits of the float)
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale);
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale);
bool has_bf16_kernels();
bool has_f32_kernels();
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min);

// int4.cpp: x [m, k] float32 (k % 32 == 0) -> int8 per group of 32 in [-127, 127], the group's
// scale d = max|x| / 127 and d * the sum of its int8 values (GGUF's Q8_1 block), each [m, k / 32]
void quantize_rows_q8(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s);
struct Q8Rows {  // quantize_rows_q8's output for m rows of k
  const int8_t* q;  // [m, k]
  const float* d;   // [m, k / 32]
  const float* s;   // [m, k / 32]
};
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);

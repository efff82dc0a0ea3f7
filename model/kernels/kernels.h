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
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min);

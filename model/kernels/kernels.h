// Declarations shared by attention.cpp and layers.cpp (model/kernels).
#pragma once

// ATen only (not torch/extension.h: pybind11 and the C++ frontend double a build's time);
// layers.cpp adds the bindings.
#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// 8 float32 partial sums of the products of 32 unsigned bytes w and signed bytes x (int4.cpp,
// int8.cpp): pairwise in int16 first (vpmaddubsw), so the caller keeps 2 * |w * x| below 2^15;
// one vpdpbusd with AVX-512 VNNI
inline __m256 dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// the sum of 8 float32 lanes
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

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
// gemm.cpp: int4_mm's integers for batches, on pack_int4_gemm's layout; y [m, n]
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n);

// int4.cpp: x [m, k] float32 (k % 32 == 0) -> int8 per group of 32 in [-127, 127], the group's
// scale d = max|x| / 127 and d * the sum of its int8 values (GGUF's Q8_1 block), each [m, k / 32]
void quantize_rows_q8(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s);
struct Q8Rows {  // quantize_rows_q8's output for m rows of k
  const int8_t* q;  // [m, k]
  const float* d;   // [m, k / 32]
  const float* s;   // [m, k / 32]
};
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
// int4.cpp: what int4_mm and int8_mm share: x [m, k] float32 -> y [m, n] float32, the rows
// quantized once (quantize_rows_q8), then tasks of output blocks (a block's weights stay in L1
// while every tile of <= 4 rows passes over them); tile(rows, m_tile, o0, o1, y_tile) fills
// y_tile[r * n + o] for r < m_tile, o in [o0, o1).
using Q8Tile = c10::function_ref<void(const Q8Rows&, int64_t, int64_t, int64_t, float*)>;
at::Tensor q8_matmul(const at::Tensor& x, int64_t n, Q8Tile tile);

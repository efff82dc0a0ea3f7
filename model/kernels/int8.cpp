// int8_mm: float32 activations times int8 weights with one float32 scale per group of 32 along
// k (GGUF's Q8_0 block), in integers as int4_mm (int4.cpp) is: the rows are quantized to int8
// per group of 32 (quantize_rows_q8), each group's dot product is exact in int32, then scaled.
// The output head of an int4 model with float32 activations (model/layers/quant.py QuantLinear "q8"):
// against fbgemm's dynamic int8 linear it keeps a scale per group of the activations instead of
// one per row (and full 8 bits where, without VNNI, fbgemm drops to 7), and it reads the same
// bytes. One source, compiled per ISA level by model/kernels/__init__.py.
//
// w [n, k] int8 in [-127, 127], scale [n, k / 32] float32: w_real = w * scale.
// y[r, o] = sum_g scale[o, g] * d[r, g] * dot(w[o, g], xq[r, g]).
#include "kernels.h"


#if defined(__AVX2__) && defined(__FMA__)
#define CELLSERVE_INT8_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;

#if defined(CELLSERVE_INT8_AVX2)
// 8 partial sums of dot(w, x), both signed: |w| times x with w's sign, the unsigned x signed
// form dot_u8s8 takes (|w|, |x| <= 127 keep vpmaddubsw's pair sums below 2^15)
inline __m256 dot(__m256i w_abs, __m256i w, __m256i x) {
  return dot_u8s8(w_abs, _mm256_sign_epi8(x, w));
}

template <int M, int NO>
void tile(const Q8Rows& x, int64_t k, const int8_t* wq, const float* ws, int64_t o, float* y,
          int64_t n) {
  const int64_t groups = k / kGroup;
  __m256 acc[NO][M];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < M; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[NO], wa[NO];
    __m256 sc[NO];
    for (int j = 0; j < NO; ++j) {
      // the rows two tiles ahead: 4 interleaved weight streams defeat the hardware prefetcher
      // (the head at 1 row, 2 threads: 2.3 -> 1.6 ms)
      _mm_prefetch(reinterpret_cast<const char*>(wq + (o + 2 * NO + j) * k + g * kGroup),
                   _MM_HINT_T0);
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (o + j) * k + g * kGroup));
      wa[j] = _mm256_sign_epi8(w[j], w[j]);
      sc[j] = _mm256_broadcast_ss(ws + (o + j) * groups + g);
    }
    for (int r = 0; r < M; ++r) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * k + g * kGroup));
      const __m256 xd = _mm256_broadcast_ss(x.d + r * groups + g);
      for (int j = 0; j < NO; ++j)
        acc[j][r] = _mm256_fmadd_ps(dot(wa[j], w[j], xv), _mm256_mul_ps(sc[j], xd), acc[j][r]);
    }
  }
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < M; ++r) y[r * n + o + j] = hsum8(acc[j][r]);
}

template <int M, int NO>
void outputs(const Q8Rows& x, int64_t k, const int8_t* wq, const float* ws, int64_t o0,
             int64_t o1, float* y, int64_t n) {
  int64_t o = o0;
  for (; o + NO <= o1; o += NO) tile<M, NO>(x, k, wq, ws, o, y, n);
  for (; o < o1; ++o) tile<M, 1>(x, k, wq, ws, o, y, n);
}

void int8_rows(const Q8Rows& x, int64_t m, int64_t k, const int8_t* wq, const float* ws,
               int64_t o0, int64_t o1, float* y, int64_t n) {
  switch (m) {
    case 1: return outputs<1, 4>(x, k, wq, ws, o0, o1, y, n);
    case 2: return outputs<2, 4>(x, k, wq, ws, o0, o1, y, n);
    case 3: return outputs<3, 2>(x, k, wq, ws, o0, o1, y, n);
    default: return outputs<4, 2>(x, k, wq, ws, o0, o1, y, n);
  }
}
#else
void int8_rows(const Q8Rows& x, int64_t m, int64_t k, const int8_t* wq, const float* ws,
               int64_t o0, int64_t o1, float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* wg = wq + o * k + g * kGroup;
        const int8_t* xg = x.q + r * k + g * kGroup;
        int32_t d = 0;
        for (int64_t j = 0; j < kGroup; ++j) d += wg[j] * xg[j];
        acc += ws[o * groups + g] * x.d[r * groups + g] * static_cast<float>(d);
      }
      y[r * n + o] = acc;
    }
  }
}
#endif

}  // namespace

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "int8_mm takes x [m, k] float32");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "int8_mm: w must be [n, k] int8");
  const int64_t k = x_in.size(1), n = w.size(0);
  TORCH_CHECK(k % kGroup == 0 && w.size(1) == k, "int8_mm: x has ", k, " columns, the weight ",
              w.size(1));
  const int64_t groups = k / kGroup;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n && scale.size(1) == groups,
              "int8_mm: scale must be [n, k / 32] float32");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return q8_matmul(x_in, n, [&](const Q8Rows& r, int64_t mr, int64_t o0, int64_t o1, float* y) {
    int8_rows(r, mr, k, wp, sp, o0, o1, y, n);
  });
}

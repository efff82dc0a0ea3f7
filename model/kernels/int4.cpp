// int4_mm: float32 activations times cellserve's int4 weights (model/quant.py QuantLinear
// "int4"), without converting the activations to bfloat16: the small-row (decode) matmul of
// the float32 default on CPUs without native bfloat16 (AVX2), where torch's int4 kernel
// takes bfloat16 only and bfloat16 is emulated. One source, compiled per ISA level by
// model/kernels/__init__.py: AVX-512 (16 lanes), AVX2+FMA (8 lanes), or portable C++.
//
// Layout (model/quant.py pack_int4): q [n, k] in [0, 15], k % 32 == 0 -> [n, k / 2] uint8, per row and
// group of 32 along k: 16 bytes, byte j = q[j] | q[16 + j] << 4 (so the low nibbles are the
// group's first 16 values in order, the high ones its last 16). scale_min [n, k / 32, 2]
// float32: w = q * scale + min (min = zero - 8 * scale of QuantLinear's (q - 8) * scale + zero).
// y[r, o] = sum_g scale[o, g] * dot(q[o, g], x[r, g]) + min[o, g] * sum(x[r, g]).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;  // activation rows sharing one pass over the weights

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kParts = 2;  // vectors per group of 32
inline void dequant(const uint8_t* b, Vec* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
}
inline Vec dot(const Vec* w, const float* x) {
  return _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(x)));
}
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec zeros() { return _mm512_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kParts = 4;
inline void dequant(const uint8_t* b, Vec* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
inline Vec dot(const Vec* w, const float* x) {  // two chains, not one of four
  const __m256 a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(x)));
  const __m256 b =
      _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(x + 16)));
  return _mm256_add_ps(a, b);
}
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec zeros() { return _mm256_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[r, o + j] for r < M, j < NO: NO output rows at once, so that M * NO accumulator chains
// (in registers: M * NO <= 8) hide the FMA latency.
template <int M, int NO>
void tile(const float* x, const float* xs, int64_t k, const uint8_t* wq, const float* sm,
          int64_t o, float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  Vec acc[NO][M];
  float z[NO][M];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < M; ++r) acc[j][r] = zeros(), z[j][r] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < NO; ++j) {
      Vec w[kParts];
      dequant(wq + (o + j) * (k / 2) + g * 16, w);
      const float* s = sm + ((o + j) * groups + g) * 2;
      const Vec scale = splat(s[0]);
      for (int r = 0; r < M; ++r) {
        acc[j][r] = fmadd(scale, dot(w, x + r * k + g * kGroup), acc[j][r]);
        z[j][r] += s[1] * xs[r * groups + g];
      }
    }
  }
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < M; ++r) y[r * n + o + j] = hsum(acc[j][r]) + z[j][r];
}

template <int M, int NO>
void rows(const float* x, const float* xs, int64_t k, const uint8_t* wq, const float* sm,
          int64_t o0, int64_t o1, float* y, int64_t n) {
  int64_t o = o0;
  for (; o + NO <= o1; o += NO) tile<M, NO>(x, xs, k, wq, sm, o, y, n);
  for (; o < o1; ++o) tile<M, 1>(x, xs, k, wq, sm, o, y, n);
}

// out rows [o0, o1) of `m` <= kRowTile activation rows x (row stride k), xs [m, groups].
void int4_rows(const float* x, const float* xs, int64_t m, int64_t k, const uint8_t* wq,
               const float* sm, int64_t o0, int64_t o1, float* y, int64_t n) {
  switch (m) {
    case 1: return rows<1, 4>(x, xs, k, wq, sm, o0, o1, y, n);
    case 2: return rows<2, 4>(x, xs, k, wq, sm, o0, o1, y, n);
    case 3: return rows<3, 2>(x, xs, k, wq, sm, o0, o1, y, n);
    default: return rows<4, 2>(x, xs, k, wq, sm, o0, o1, y, n);
  }
}
#else
// portable C++ (aarch64, x86 before AVX2): the compiler's own vectorisation
void int4_rows(const float* x, const float* xs, int64_t m, int64_t k, const uint8_t* wq,
               const float* sm, int64_t o0, int64_t o1, float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wrow = wq + o * (k / 2);
    const float* srow = sm + o * groups * 2;
    float acc[kRowTile] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = wrow + g * 16;
      float w[kGroup];
      for (int64_t j = 0; j < 16; ++j) {
        w[j] = static_cast<float>(b[j] & 0x0F);
        w[16 + j] = static_cast<float>(b[j] >> 4);
      }
      for (int64_t r = 0; r < m; ++r) {
        const float* xg = x + r * k + g * kGroup;
        float d = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) d += w[j] * xg[j];
        acc[r] += srow[2 * g] * d + srow[2 * g + 1] * xs[r * groups + g];
      }
    }
    for (int64_t r = 0; r < m; ++r) y[r * n + o] = acc[r];
  }
}
#endif

}  // namespace

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_min) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "int4_mm takes x [m, k] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_mm: packed must be pack_int4's [n, k / 2] uint8");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = packed.size(0);
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) * 2 == k, "int4_mm: x has ", k,
              " columns, the weight ", packed.size(1) * 2);
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == n &&
                  scale_min.size(1) == k / kGroup && scale_min.size(2) == 2,
              "int4_mm: scale_min must be [n, k / 32, 2] float32");
  auto x = x_in.contiguous();
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int64_t groups = k / kGroup;
  auto xs = x.view({m, groups, kGroup}).sum(-1).contiguous();  // [m, groups]
  const float* xp = x.data_ptr<float>();
  const float* xsp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale_min.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // grain: ~64K weights a task, so that a 576-wide layer splits over the threads
  const int64_t grain = std::max<int64_t>(8, 65536 / k);
  at::parallel_for(0, n, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
      const int64_t mr = std::min(kRowTile, m - r0);
      int4_rows(xp + r0 * k, xsp + r0 * groups, mr, k, wp, sp, o0, o1, yp + r0 * n, n);
    }
  });
  return y;
}

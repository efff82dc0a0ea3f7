// int4_mm: float32 activations times cellserve's int4 weights (model/layers/quant.py QuantLinear
// "int4"), in integers: each activation row is quantized to int8 per group of 32 (one float32
// scale a group, as GGUF's Q8_0 / Q8_1), and each group's dot product with the 4-bit weights is
// exact in int32 (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with AVX-512 VNNI), then scaled in
// float32. This is how llama.cpp multiplies Q4_1 by its activations; against the float32
// activations it costs SmolLM2-135M little (README: accuracy) and it runs ~2x the float
// dequantize-and-FMA it replaces. The float32 rows of the avx2 / avx512 paths (no native
// bfloat16) take it, for every batch size. One source, compiled per ISA level by
// model/kernels/__init__.py: AVX-512 VNNI, AVX2, or portable C++ (aarch64, older x86).
//
// Layout (model/layers/quant.py pack_int4): q [n, k] in [0, 15], k % 32 == 0 -> [n, k / 2] uint8, per
// row and group of 32 along k: 16 bytes, byte j = q[j] | q[16 + j] << 4 (the low nibbles are the
// group's first 16 values in order, the high ones its last 16). scale_min [n, 2, k / 32]
// float32: row o's group scales, then its group minimums: w = q * scale + min.
// Activations (quantize_rows_q8): per row r and group g, d = max|x| / 127, xq = round(x / d) in
// [-127, 127], and s = d * sum(xq): the minimum's term takes the quantized rows' sum, not the
// exact one, so that the result is exactly the quantized rows times the weights (with the exact
// sum, q * scale = w - min is all of one sign and the rounding errors add up: ~2x the error).
// y[r, o] = sum_g scale[o, g] * d[r, g] * dot(q[o, g], xq[r, g]) + min[o, g] * s[r, g].
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define CELLSERVE_INT4_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;  // activation rows sharing one pass over a block of weights
constexpr int64_t kOutBlock = 64;  // outputs whose weights stay in L1 while the rows stream

// min[o, :] . s[r, :] over the groups: the minimums' term
inline float min_term(const float* mn, const float* s, int64_t groups) {
  float acc = 0.f;
  for (int64_t g = 0; g < groups; ++g) acc += mn[g] * s[g];
  return acc;
}

#if defined(CELLSERVE_INT4_AVX2)
// the 32 nibbles of a group, in order, as unsigned bytes (dot_u8s8's w: 2 * 15 * 127 < 2^15)
inline __m256i nibbles(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// y[r, o + j] for r < M, j < NO (M * NO accumulators in registers hide the latencies)
template <int M, int NO>
void tile(const Q8Rows& x, int64_t k, const uint8_t* wq, const float* sm, int64_t o, float* y,
          int64_t n) {
  const int64_t groups = k / kGroup;
  __m256 acc[NO][M];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < M; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[NO];
    __m256 ws[NO];
    for (int j = 0; j < NO; ++j) {
      // the rows two tiles ahead (SmolLM2's layers, 2 threads, 1 row: 4.5 -> 4.0 ms)
      _mm_prefetch(reinterpret_cast<const char*>(wq + (o + 2 * NO + j) * (k / 2) + g * 16),
                   _MM_HINT_T0);
      w[j] = nibbles(wq + (o + j) * (k / 2) + g * 16);
      ws[j] = _mm256_broadcast_ss(sm + (o + j) * 2 * groups + g);
    }
    for (int r = 0; r < M; ++r) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * k + g * kGroup));
      const __m256 xd = _mm256_broadcast_ss(x.d + r * groups + g);
      for (int j = 0; j < NO; ++j)
        acc[j][r] = _mm256_fmadd_ps(dot_u8s8(w[j], xv), _mm256_mul_ps(ws[j], xd), acc[j][r]);
    }
  }
  for (int j = 0; j < NO; ++j) {
    const float* mn = sm + (o + j) * 2 * groups + groups;
    for (int r = 0; r < M; ++r)
      y[r * n + o + j] = hsum8(acc[j][r]) + min_term(mn, x.s + r * groups, groups);
  }
}

template <int M, int NO>
void outputs(const Q8Rows& x, int64_t k, const uint8_t* wq, const float* sm, int64_t o0,
             int64_t o1, float* y, int64_t n) {
  int64_t o = o0;
  for (; o + NO <= o1; o += NO) tile<M, NO>(x, k, wq, sm, o, y, n);
  for (; o < o1; ++o) tile<M, 1>(x, k, wq, sm, o, y, n);
}

// out [o0, o1) of m <= kRowTile rows
void int4_rows(const Q8Rows& x, int64_t m, int64_t k, const uint8_t* wq, const float* sm,
               int64_t o0, int64_t o1, float* y, int64_t n) {
  switch (m) {
    case 1: return outputs<1, 4>(x, k, wq, sm, o0, o1, y, n);
    case 2: return outputs<2, 4>(x, k, wq, sm, o0, o1, y, n);
    case 3: return outputs<3, 2>(x, k, wq, sm, o0, o1, y, n);
    default: return outputs<4, 2>(x, k, wq, sm, o0, o1, y, n);
  }
}
#else
// portable C++: the same integers, the same float32 scaling per group
void int4_rows(const Q8Rows& x, int64_t m, int64_t k, const uint8_t* wq, const float* sm,
               int64_t o0, int64_t o1, float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wrow = wq + o * (k / 2);
    const float* scale = sm + o * 2 * groups;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* xr = x.q + r * k;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = wrow + g * 16;
        const int8_t* xg = xr + g * kGroup;
        int32_t d = 0;
        for (int64_t j = 0; j < 16; ++j) d += (b[j] & 0x0F) * xg[j] + (b[j] >> 4) * xg[16 + j];
        acc += scale[g] * x.d[r * groups + g] * static_cast<float>(d);
      }
      y[r * n + o] = acc + min_term(scale + groups, x.s + r * groups, groups);
    }
  }
}
#endif

#if defined(CELLSERVE_INT4_AVX2)
// one group of 32: its int8 values, scale and scaled sum (the portable loop's values: x * inv
// rounded to nearest even, as nearbyint in the default rounding mode)
inline void quantize_group(const float* xg, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xg + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float mx = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                       _mm256_add_epi32(i32[2], i32[3]));
  // packs interleave the 128-bit lanes: 0 1 2 3 of each lane -> a final dword permute
  const __m256i w16a = _mm256_packs_epi32(i32[0], i32[1]), w16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                 _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b8);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *d = mx / 127.f;
  *s = *d * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#else
inline void quantize_group(const float* xg, int8_t* q, float* d, float* s) {
  float amax = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kGroup; ++j) {
    const auto v = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
    q[j] = v;
    sum += v;
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(sum);
}
#endif

}  // namespace

// x [m, k] float32 -> int8 per group of 32, its scale, and the scaled sum of its int8 values
void quantize_rows_q8(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s) {
  at::parallel_for(0, m * (k / kGroup), 256, [&](int64_t begin, int64_t end) {
    // group i: row i / groups, group i % groups (rows are contiguous, so groups are too)
    for (int64_t i = begin; i < end; ++i) quantize_group(x + i * kGroup, q + i * kGroup, d + i, s + i);
  });
}


at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_min) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "int4_mm takes x [m, k] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_mm: packed must be pack_int4's [n, k / 2] uint8");
  const int64_t k = x_in.size(1), n = packed.size(0);
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) * 2 == k, "int4_mm: x has ", k,
              " columns, the weight ", packed.size(1) * 2);
  const int64_t groups = k / kGroup;
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == n && scale_min.size(1) == 2 &&
                  scale_min.size(2) == groups,
              "int4_mm: scale_min must be [n, 2, k / 32] float32");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale_min.data_ptr<float>();
  return q8_matmul(x_in, n, [&](const Q8Rows& r, int64_t mr, int64_t o0, int64_t o1, float* y) {
    int4_rows(r, mr, k, wp, sp, o0, o1, y, n);
  });
}

Q8Rows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xds;
  xq.resize(m * k);
  xds.resize(2 * m * groups);
  quantize_rows_q8(x.data_ptr<float>(), m, k, xq.data(), xds.data(), xds.data() + m * groups);
  return {xq.data(), xds.data(), xds.data() + m * groups};
}

at::Tensor q8_matmul(const at::Tensor& x_in, int64_t n, Q8Tile tile) {
  auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Q8Rows rows = quantize_rows(x);
  float* yp = y.data_ptr<float>();
  // grain: ~64K weights a task, so that a 576-wide layer splits over the threads
  const int64_t grain = std::max<int64_t>(8, 65536 / k);
  at::parallel_for(0, n, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t o0 = b0; o0 < b1; o0 += kOutBlock) {
      const int64_t o1 = std::min(b1, o0 + kOutBlock);
      for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
        const Q8Rows at_r{rows.q + r0 * k, rows.d + r0 * groups, rows.s + r0 * groups};
        tile(at_r, std::min(kRowTile, m - r0), o0, o1, yp + r0 * n);
      }
    }
  });
  return y;
}

// int4_gemm: float32 rows times int4 weights for batches (prompt chunks, large decode steps):
// the same integers as int4_mm (int4.cpp: activations quantized to int8 per group of 32, each
// group's dot product exact in int32, scaled in float32), laid out for a GEMM micro-kernel
// instead of a dot product. int4_mm reads 4-bit weights once per tile of <= 4 rows: bytes are
// what a few rows cost. A batch is compute-bound, and there the weights as unsigned bytes,
// interleaved by 8 outputs, let one vpmaddubsw multiply 4 values of one row by 8 outputs at
// once and one vpaddw accumulate them in int16 over the whole group (2 instructions per 32
// multiply-adds; oneDNN's float32 GEMM, what batches took before, does 8 per FMA), with the
// float32 scaling once per group and 8 outputs. With AVX-512 VNNI one vpdpbusd does both.
// One source, compiled per ISA level by model/kernels/__init__.py; portable C++ elsewhere.
//
// Layout (model/layers/quant.py pack_int4_gemm), one uint8 tensor [n8 / 8, k / 32, 320], n8 = n rounded
// up to 8 (the padding has zero weights and scales): for block b of 8 outputs and group g of 32
// along k, 8 steps of 4 consecutive k, each 8 outputs x 4 values in [0, 15] (256 bytes), then
// the 8 outputs' float32 scales and their 8 minimums (64 bytes; w = q * scale + min, as
// pack_int4): one stream of weights a block, its scales next to its values.
// y[r, o] = sum_g scale[o, g] * d[r, g] * dot(q[o, g], xq[r, g]) + min[o, g] * s[r, g], with
// quantize_rows_q8's d and s; a row's values do not depend on the other rows of the batch.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 320;  // 256 bytes of values, 8 scales, 8 minimums
constexpr int64_t kRowChunk = 256;  // rows whose int8 values stay in L2 while weights stream
// a tile: 3 rows x 2 blocks of 8 outputs (6 group sums in registers; 2x4, 4x2, 6x1, 8x1, 2x2,
// 5x1, 3x3 and 1x8 measured slower on Zen 4's AVX2 path, one thread: 3x2 114 GMAC/s)
constexpr int kRows = 3;
constexpr int kBlocks = 2;

#if defined(__AVX2__) && defined(__FMA__)
// the int32 group sums of one row and 8 outputs: int16 pairs summed over the group's 8 steps
// (|sum| <= 8 * 2 * 15 * 127 < 2^15, so vpaddw never wraps) then one vpmaddwd, or vpdpbusd
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
using Acc = __m256i;
inline Acc step(Acc a, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(a, w, x); }
inline __m256 group_sum(Acc a) { return _mm256_cvtepi32_ps(a); }
#else
using Acc = __m256i;
inline Acc step(Acc a, __m256i w, __m256i x) {
  return _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x));
}
inline __m256 group_sum(Acc a) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(a, _mm256_set1_epi16(1)));
}
#endif

// y[r, 8 * (b + j) + i] for r < M, j < NB, i < 8 (outputs past n are not written)
template <int M, int NB>
void tile(const Q8Rows& x, int64_t k, const uint8_t* w, int64_t b, float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  __m256 acc[M][NB];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    Acc s[M][NB];
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < NB; ++j) s[r][j] = _mm256_setzero_si256();
    // not unrolled: unrolled, GCC hoists the 8 steps' products and spills them (~1.5x slower)
#pragma GCC unroll 1
    for (int64_t q = 0; q < kGroup / 4; ++q) {
      __m256i wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + ((b + j) * groups + g) * kGroupBytes + q * 32));
      for (int r = 0; r < M; ++r) {
        int32_t four;
        std::memcpy(&four, x.q + r * k + g * kGroup + q * 4, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int j = 0; j < NB; ++j) s[r][j] = step(s[r][j], wv[j], xv);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const auto* p = reinterpret_cast<const float*>(w + ((b + j) * groups + g) * kGroupBytes + 256);
      const __m256 sc = _mm256_loadu_ps(p), mn = _mm256_loadu_ps(p + 8);
      for (int r = 0; r < M; ++r) {
        const __m256 dx = _mm256_set1_ps(x.d[r * groups + g]);
        const __m256 sx = _mm256_set1_ps(x.s[r * groups + g]);
        acc[r][j] = _mm256_fmadd_ps(group_sum(s[r][j]), _mm256_mul_ps(sc, dx), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(mn, sx, acc[r][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t o = (b + j) * 8;
    if (o + 8 <= n) {
      for (int r = 0; r < M; ++r) _mm256_storeu_ps(y + r * n + o, acc[r][j]);
    } else {
      alignas(32) float tmp[8];
      for (int r = 0; r < M; ++r) {
        _mm256_store_ps(tmp, acc[r][j]);
        for (int64_t i = 0; o + i < n; ++i) y[r * n + o + i] = tmp[i];
      }
    }
  }
}


template <int M>
void rows_of(const Q8Rows& x, int64_t k, const uint8_t* w, int64_t b0, int64_t b1, float* y,
             int64_t n) {
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks) tile<M, kBlocks>(x, k, w, b, y, n);
  for (; b < b1; ++b) tile<M, 1>(x, k, w, b, y, n);
}

// blocks [b0, b1) of m rows
void gemm_rows(const Q8Rows& x, int64_t m, int64_t k, const uint8_t* w, int64_t b0, int64_t b1,
               float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) {
    const Q8Rows at{x.q + r * k, x.d + r * groups, x.s + r * groups};
    rows_of<kRows>(at, k, w, b0, b1, y + r * n, n);
  }
  const Q8Rows at{x.q + r * k, x.d + r * groups, x.s + r * groups};
  switch (m - r) {
    case 3: return rows_of<3>(at, k, w, b0, b1, y + r * n, n);
    case 2: return rows_of<2>(at, k, w, b0, b1, y + r * n, n);
    case 1: return rows_of<1>(at, k, w, b0, b1, y + r * n, n);
    default: return;
  }
}
#else
// portable C++: the same integers, the same float32 operations per group in the same order
void gemm_rows(const Q8Rows& x, int64_t m, int64_t k, const uint8_t* w, int64_t b0, int64_t b1,
               float* y, int64_t n) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t i = 0; i < 8 && b * 8 + i < n; ++i) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t dot = 0;
          for (int64_t j = 0; j < kGroup; ++j)
            dot += w[(b * groups + g) * kGroupBytes + (j / 4) * 32 + i * 4 + j % 4] *
                   x.q[r * k + g * kGroup + j];
          float p[16];
          std::memcpy(p, w + (b * groups + g) * kGroupBytes + 256, sizeof(p));
          acc += static_cast<float>(dot) * (p[i] * x.d[r * groups + g]);
          acc += p[8 + i] * x.s[r * groups + g];
        }
        y[r * n + b * 8 + i] = acc;
      }
    }
  }
}
#endif

}  // namespace

at::Tensor int4_gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t n) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "int4_gemm takes x [m, k] float32");
  const int64_t m = x_in.size(0), k = x_in.size(1), groups = k / kGroup, blocks = (n + 7) / 8;
  TORCH_CHECK(k % kGroup == 0, "int4_gemm: k must be a multiple of 32, got ", k);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(0) == blocks && w.size(1) == groups && w.size(2) == kGroupBytes,
              "int4_gemm: w must be pack_int4_gemm's [n8 / 8, k / 32, 320] uint8 for n = ", n,
              ", k = ", k);
  auto x = x_in.contiguous();
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Q8Rows rows = quantize_rows(x);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // tasks: (row chunk, kBlocks output blocks); a tile's weights stay in L1 over the chunk's rows
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk, spans = (blocks + kBlocks - 1) / kBlocks;
  at::parallel_for(0, chunks * spans, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / spans, p = t % spans;
      const int64_t r0 = c * kRowChunk, chunk = std::min(kRowChunk, m - r0);
      const Q8Rows at{rows.q + r0 * k, rows.d + r0 * groups, rows.s + r0 * groups};
      gemm_rows(at, chunk, k, wp, kBlocks * p, std::min(blocks, kBlocks * (p + 1)), yp + r0 * n,
                n);
    }
  });
  return y;
}

// The 32-value kinds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) at a few rows (q_gemv): each pair of blocks
// decoded in registers and summed with every row at once, no L1 buffer between the two. Same
// integers, same float operations in the same order as q_task's tiles (ggml_q32tiles.h), so a
// row's outputs do not depend on how many rows came with it. Included by ggml_blocks.cpp only.
//
// Why a second kernel: at one row the tiles' per-(pair, output) work is the decode plus a store
// of the decoded pair to the buffer and its load back, for one dot product; the round trip cost
// about as much as the decode (Q5_0 1536x576 at one row: ~15 GB/s from L2 on a Zen 4, where the
// K-quants' k_gemv reads ~26 GB/s from memory).
#pragma once

#include "ggml_q32tiles.h"

#if defined(CELLSERVE_GGML_TILE32)

#include <vector>

namespace {

using namespace ggml;

constexpr int64_t kQGemvRows = 5;  // rows up to which q_gemv takes a batch (4 at a time)

// Pair p of an output's row -> its values (S: |q|, sg: q), its two scales in a vector's halves
template <int64_t T, bool S>
inline void gemv_pair(const uint8_t* row, int64_t p, bool two, float* mn, __m256i& u0, __m256i& u1,
                      __m256i& sg0, __m256i& sg1, float& d0, float& d1) {
  constexpr int64_t B = Fmt<T>::B;
  d1 = 0.f;
  u0 = dec32<T>(row + 2 * p * B, d0, mn[2 * p]);
  u1 = two ? dec32<T>(row + (2 * p + 1) * B, d1, mn[2 * p + 1]) : _mm256_setzero_si256();
  sg0 = u0, sg1 = u1;
  if constexpr (S) {
    u0 = _mm256_abs_epi8(u0);
    u1 = _mm256_abs_epi8(u1);
  }
}

#if defined(CELLSERVE_GGML_ZMM)
// Blocks 2p and 2p + 1 of a 4- or 5-bit kind (both present) -> their 64 values in one ZMM: the
// two blocks' 16 bytes of nibbles spread to the four 128-bit lanes by one permute and one
// variable shift, the fifth bits set from the two 32-bit qh words as one byte mask. The same
// bytes as dec32 of each block (nib32 | bit5), a third of its instructions.
template <int64_t T>
inline __m512i dec_pair_zmm(const uint8_t* b, float* mn, float& d0, float& d1) {
  constexpr int64_t B = Fmt<T>::B, qs = kNibOffset<T>;
  const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs));
  const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + B + qs));
  const __m512i lanes = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                 _mm512_castsi256_si512(_mm256_set_m128i(a1, a0)));
  __m512i u = _mm512_and_si512(_mm512_srlv_epi64(lanes, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                               _mm512_set1_epi8(0x0F));
  if constexpr (T == Q5_0 || T == Q5_1) {
    uint32_t h0, h1;
    std::memcpy(&h0, b + qs - 4, 4);
    std::memcpy(&h1, b + B + qs - 4, 4);
    const __mmask64 hi = static_cast<uint64_t>(h0) | static_cast<uint64_t>(h1) << 32;
    u = _mm512_mask_add_epi8(u, hi, u, _mm512_set1_epi8(0x10));
  }
  nib_dm<T>(b, d0, mn[0]);
  nib_dm<T>(b + B, d1, mn[1]);
  return u;
}

// q_gemv_outs' pair p on AVX-512: both blocks present (TWO) or the odd last one alone
template <int64_t T, int R, int NO, bool TWO>
__attribute__((always_inline)) inline void zmm_pair(const Q8Rows& X, int64_t k, int64_t groups,
                                                    int64_t npairs, const uint8_t* w,
                                                    int64_t row_bytes, int64_t o, int64_t p,
                                                    const __m512* xsv, float* mn, __m512 (&f)[NO][R]) {
  constexpr int64_t B = Fmt<T>::B;
  constexpr bool S = T == Q8_0 && kQ8Signed;
  // the next NO outputs' rows (they follow these in memory), a group ahead as one stream: a
  // prefetch within each of NO short rows (an output head's 952 bytes) kept the prefetcher
  // re-learning 4 streams a group (Qwen2.5-0.5B's Q8_0 head at one row: 9.8 ms, against
  // 6.2 ms through the tiles, which read the rows one after another)
  const uint8_t* ahead = w + (o + NO) * row_bytes + p * NO * 2 * B;
  for (int64_t l = 0; l < NO * 2 * B; l += 64) __builtin_prefetch(ahead + l);
  __m512i wv[NO];
  __m512 ws[NO];
  __mmask64 neg[NO];
#pragma GCC unroll 4
  for (int j = 0; j < NO; ++j) {
    const uint8_t* row = w + (o + j) * row_bytes;
    float d0, d1;
    neg[j] = 0;
    if constexpr (kNibbles<T> && TWO) {
      wv[j] = dec_pair_zmm<T>(row + 2 * p * B, mn + j * groups + 2 * p, d0, d1);
    } else {
      __m256i u0, u1, sg0, sg1;
      gemv_pair<T, S>(row, p, TWO, mn + j * groups, u0, u1, sg0, sg1, d0, d1);
      wv[j] = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
      if constexpr (S) neg[j] = _mm512_movepi8_mask(_mm512_inserti64x4(_mm512_castsi256_si512(sg0), sg1, 1));
    }
    ws[j] = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
  }
  constexpr __mmask64 mask = TWO ? ~0ull : 0xFFFFFFFFull;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_maskz_loadu_epi8(mask, X.q + r * k + 64 * p);
    const __m512 xsr = xsv[r * npairs + p];
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) {
#if defined(__AVX512VNNI__)
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
#else
      __m512i xr = xv;
      if constexpr (S) xr = _mm512_mask_sub_epi8(xr, neg[j], _mm512_setzero_si512(), xr);
      const __m512i dot = _mm512_madd_epi16(_mm512_maddubs_epi16(wv[j], xr), _mm512_set1_epi16(1));
#endif
      f[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[j], xsr), f[j][r]);
    }
  }
}
#endif

// Rows [0, R) of X (rows k apart; their scales and sums `groups` apart) times outputs
// [o, o + NO): NO rows of weights side by side (NO streams for the prefetcher), a pair of
// blocks at a time. xs: the rows' scales as q_micro broadcasts them (R x npairs, ZMM only).
template <int64_t T, int R, int NO>
void q_gemv_outs(const Q8Rows& X, int64_t k, int64_t n, float* y, const uint8_t* w,
                 int64_t row_bytes, int64_t o, int64_t col0, const void* xs, float* mn) {
  const int64_t groups = k / kQ, npairs = (groups + 1) / 2;
#if defined(CELLSERVE_GGML_ZMM)
  const __m512* xsv = static_cast<const __m512*>(xs);
  __m512 f[NO][R];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < R; ++r) f[j][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < groups / 2; ++p) zmm_pair<T, R, NO, true>(X, k, groups, npairs, w, row_bytes, o, p, xsv, mn, f);
  if (groups % 2) zmm_pair<T, R, NO, false>(X, k, groups, npairs, w, row_bytes, o, groups / 2, xsv, mn, f);
#else
  constexpr int64_t B = Fmt<T>::B;
  constexpr bool S = T == Q8_0 && kQ8Signed;
  __m256 f[NO][R];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < R; ++r) f[j][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < npairs; ++p) {
    const bool two = 2 * p + 1 < groups;
    const uint8_t* ahead = w + (o + NO) * row_bytes + p * NO * 2 * B;  // zmm_pair's NOTE
    for (int64_t l = 0; l < NO * 2 * B; l += 64) __builtin_prefetch(ahead + l);
    __m256i wv[NO][2], sg[NO][2];
    float dw[NO][2];
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) {
      const uint8_t* row = w + (o + j) * row_bytes;
      gemv_pair<T, S>(row, p, two, mn + j * groups, wv[j][0], wv[j][1], sg[j][0], sg[j][1], dw[j][0], dw[j][1]);
    }
    for (int h = 0; h < (two ? 2 : 1); ++h) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q + r * k + 64 * p + 32 * h));
        const __m256 xsr = _mm256_set1_ps(X.d[r * groups + 2 * p + h]);
#pragma GCC unroll 4
        for (int j = 0; j < NO; ++j) {
          const __m256i xr = S ? _mm256_sign_epi8(xv, sg[j][h]) : xv;
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j][h], xr), ones);
          f[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(dw[j][h]), xsr), f[j][r]);
        }
      }
    }
  }
#endif
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < R; ++r)
      y[r * n + col0 + o + j] = qacc_sum(f[j][r]) + min_dot(mn + j * groups, X.s + r * groups, groups);
}

constexpr int kGemvNO = 4;  // outputs side by side

template <int64_t T, int R>
void q_gemv(const Q8Rows& X, int64_t k, int64_t n, float* y, const uint8_t* w, int64_t row_bytes,
            int64_t o0, int64_t o1, int64_t col0) {
  const int64_t groups = k / kQ;
  thread_local std::vector<float> mnv;
  mnv.resize(kGemvNO * groups + 1);
  const void* xs = nullptr;
#if defined(CELLSERVE_GGML_ZMM)
  // an odd last block's partner lanes 0 (q_micro reads one float past: the same +0 products)
  const int64_t npairs = (groups + 1) / 2;
  thread_local std::vector<__m512> xsv;
  xsv.resize(R * npairs);
  const __m512i lane8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int r = 0; r < R; ++r)
    for (int64_t p = 0; p < npairs; ++p) {
      const float* d = X.d + r * groups + 2 * p;
      const __m128 two = 2 * p + 1 < groups ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d))) : _mm_load_ss(d);
      xsv[r * npairs + p] = _mm512_permutexvar_ps(lane8, _mm512_castps128_ps512(two));
    }
  xs = xsv.data();
#endif
  int64_t o = o0;
  for (; o + kGemvNO <= o1; o += kGemvNO) q_gemv_outs<T, R, kGemvNO>(X, k, n, y, w, row_bytes, o, col0, xs, mnv.data());
  for (; o < o1; ++o) q_gemv_outs<T, R, 1>(X, k, n, y, w, row_bytes, o, col0, xs, mnv.data());
}

// A task's outputs of a 32-value part at up to kQGemvRows rows, 4 rows at a time
template <int64_t T>
void q_gemv_rows(const Q8Rows& X, int64_t m, int64_t k, int64_t n, float* y, const uint8_t* w,
                 int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  const int64_t groups = k / kQ;
  for (int64_t r = 0; r < m; r += 4) {
    const Q8Rows Xr{X.q + r * k, X.d + r * groups, X.s + r * groups};
    float* yr = y + r * n;
    switch (std::min<int64_t>(4, m - r)) {
      case 1: q_gemv<T, 1>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
      case 2: q_gemv<T, 2>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
      case 3: q_gemv<T, 3>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
      default: q_gemv<T, 4>(Xr, k, n, yr, w, row_bytes, o0, o1, col0);
    }
  }
}

}  // namespace

#endif  // CELLSERVE_GGML_TILE32

// The 32-value kinds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of ggml_linear on AVX2 / AVX-512: register
// tiles over blocks decoded in pairs (q_task). Included by ggml_blocks.cpp only (its run_task
// calls q_task where CELLSERVE_GGML_TILE32 is defined).
#pragma once

#include "ggml_formats.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace ggml;

constexpr int64_t kQ = 32;  // values per activation scale

// ---- the 32-value kinds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on AVX2 / AVX-512: register tiles ----
//
// Each block decoded (vectorized, a pair of blocks at a time) into 32 unsigned values u, its
// scale d and a minimum mn with w = d * u + mn: Q4_0 u = q, mn = -8d; Q5_0 u = q, mn = -16d;
// Q4_1 / Q5_1 their own m; Q8_0 with VNNI u = q + 128, mn = -128d (vpdpbusd: 255 * 127 pairs
// would saturate vpmaddubsw), without u = |q| and the sign of q moved onto the activations
// (vpsignb / a masked negation per output and row, as llama.cpp's AVX2 Q8_0 dot). Per block and
// (output, row): the
// exact int32 dot of u and the row's int8 values, times d * d_x, in float; the minimums' term
// sum_g mn[g] * s_x[g] (s_x: d_x * the sum of the block's int8 values) as one float dot product
// per (output, row) at the end. Tiles of kNO32 outputs x kMR32 rows, float accumulators in
// registers; the blocks decoded once per tile of rows into an L1 buffer of kKB32 pairs.
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define CELLSERVE_GGML_TILE32 1

struct QPair {
  alignas(64) uint8_t u[64];  // block 2p's 32 values, then 2p + 1's
  alignas(64) float ws[16];   // lanes 0-7: block 2p's d, 8-15: 2p + 1's
  alignas(64) int8_t sg[64];  // Q8_0 without VNNI: q, whose sign moves onto the activations
};

#if defined(__AVX512VNNI__)
constexpr bool kQ8Signed = false;
#else
constexpr bool kQ8Signed = true;
#endif

inline __m256i nib32(const uint8_t* qs) {  // 16 bytes of nibbles -> 32 values in order
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i f = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(a, 4), f), _mm_and_si128(a, f));
}

inline __m256i bit5(const uint8_t* qhp) {  // bit j of 32 -> 0x10 in byte j
  uint32_t qh;
  std::memcpy(&qh, qhp, 4);
  const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                       2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), idx);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits), _mm256_set1_epi8(0x10));
}

// the 4- and 5-bit kinds: d, then (Q4_1, Q5_1) m, then (Q5_0, Q5_1) 32 fifth bits, then 16
// bytes of nibbles
template <int64_t T>
constexpr bool kNibbles = T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1;
template <int64_t T>
constexpr int64_t kNibOffset = 2 + (T == Q4_1 || T == Q5_1 ? 2 : 0) + (T == Q5_0 || T == Q5_1 ? 4 : 0);

// a 4- or 5-bit block's scale d and the offset mn of its values: d * u + mn
template <int64_t T>
inline void nib_dm(const uint8_t* b, float& d, float& mn) {
  d = fp16(b);
  if constexpr (T == Q4_0 || T == Q5_0)
    mn = (T == Q4_0 ? -8.f : -16.f) * d;
  else
    mn = fp16(b + 2);
}

// one block -> u, d, mn
template <int64_t T>
inline __m256i dec32(const uint8_t* b, float& d, float& mn) {
  if constexpr (kNibbles<T>) {
    nib_dm<T>(b, d, mn);
    const __m256i u = nib32(b + kNibOffset<T>);
    if constexpr (T == Q5_0 || T == Q5_1) return _mm256_or_si256(u, bit5(b + kNibOffset<T> - 4));
    return u;
  } else if constexpr (T == MXFP4) {  // u = code's value + 12 (0..24), mn = -12 d
    d = e8m0_half(b[0]), mn = -12.f * d;
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return _mm256_shuffle_epi8(lut, nib32(b + 1));
  } else if constexpr (kQ8Signed) {  // Q8_0: its signed values (dec_pair takes |q| and the sign)
    d = fp16(b), mn = 0.f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {  // Q8_0
    d = fp16(b), mn = -128.f * d;
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
}

// blocks [2p, 2p + 2) of a row (the second only where 2p + 1 < nb: else zeros) -> o, mn
template <int64_t T>
inline void dec_pair(const uint8_t* row, int64_t p, int64_t nb, QPair& o, float* mn) {
  constexpr int64_t B = Fmt<T>::B;
  float d0, d1 = 0.f, m1 = 0.f;
  __m256i u0 = dec32<T>(row + 2 * p * B, d0, mn[2 * p]);
  __m256i u1 = _mm256_setzero_si256();
  if (2 * p + 1 < nb) {
    u1 = dec32<T>(row + (2 * p + 1) * B, d1, m1);
    mn[2 * p + 1] = m1;
  }
  if constexpr (T == Q8_0 && kQ8Signed) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.sg), u0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.sg + 32), u1);
    u0 = _mm256_abs_epi8(u0);
    u1 = _mm256_abs_epi8(u1);
  }
#if defined(CELLSERVE_GGML_ZMM)
  _mm512_store_si512(o.u, _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1));
  _mm512_store_ps(o.ws, _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1));
#else
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.u), u0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.u + 32), u1);
  o.ws[0] = d0;
  o.ws[8] = d1;
#endif
}

// sum_g mn[g] * s[g]
inline float min_dot(const float* mn, const float* s, int64_t groups) {
  __m256 a = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(s + g), a);
  float t = hsum8(a);
  for (; g < groups; ++g) t += mn[g] * s[g];
  return t;
}

constexpr int64_t kKB32 = 16;  // pairs decoded at a time
#if defined(CELLSERVE_GGML_ZMM)
constexpr int kNO32 = 4, kMR32 = 4;
using QAcc = __m512;
inline QAcc qacc_zero() { return _mm512_setzero_ps(); }
inline float qacc_sum(QAcc a) { return _mm512_reduce_add_ps(a); }
// rows [0, MR) (x: row 0 at pair p0, rows k apart; xd: row 0's d at block 2 p0, rows groups
// apart) times outputs [0, NO) over np pairs of buf (output j's at buf + j * kKB32)
template <int NO, int MR, bool S>
void q_micro(const QPair* buf, int64_t np, int64_t half_last, const int8_t* x, int64_t k,
             const float* xd, int64_t groups, QAcc* facc, int64_t nr) {
  const __m512i lane8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 f[NO][MR];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < MR; ++r) f[j][r] = facc[j * nr + r];
  for (int64_t p = 0; p < np; ++p) {
    const __mmask64 mask = (half_last && p == np - 1) ? 0xFFFFFFFFull : ~0ull;
    __m512i xv[MR];
    __m512 xs[MR];
    for (int r = 0; r < MR; ++r) {
      xv[r] = _mm512_maskz_loadu_epi8(mask, x + r * k + 64 * p);
      xs[r] = _mm512_permutexvar_ps(
          lane8, _mm512_castps128_ps512(_mm_castpd_ps(
                     _mm_load_sd(reinterpret_cast<const double*>(xd + r * groups + 2 * p)))));
    }
    for (int j = 0; j < NO; ++j) {
      const QPair& w = buf[j * kKB32 + p];
      const __m512i wv = _mm512_load_si512(w.u);
      const __m512 ws = _mm512_load_ps(w.ws);
      __mmask64 neg = 0;
      if constexpr (S) neg = _mm512_movepi8_mask(_mm512_load_si512(w.sg));
      for (int r = 0; r < MR; ++r) {
#if defined(__AVX512VNNI__)
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[r]);
#else
        __m512i xr = xv[r];
        if constexpr (S) xr = _mm512_mask_sub_epi8(xr, neg, _mm512_setzero_si512(), xr);
        const __m512i dot = _mm512_madd_epi16(_mm512_maddubs_epi16(wv, xr), _mm512_set1_epi16(1));
#endif
        f[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs[r]), f[j][r]);
      }
    }
  }
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < MR; ++r) facc[j * nr + r] = f[j][r];
}
#else
constexpr int kNO32 = 2, kMR32 = 2;
using QAcc = __m256;
inline QAcc qacc_zero() { return _mm256_setzero_ps(); }
inline float qacc_sum(QAcc a) { return hsum8(a); }
template <int NO, int MR, bool S>
void q_micro(const QPair* buf, int64_t np, int64_t half_last, const int8_t* x, int64_t k,
             const float* xd, int64_t groups, QAcc* facc, int64_t nr) {
  __m256 f[NO][MR];
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < MR; ++r) f[j][r] = facc[j * nr + r];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < np; ++p) {
    const int halves = (half_last && p == np - 1) ? 1 : 2;
    for (int h = 0; h < halves; ++h) {
      __m256i xv[MR];
      __m256 xs[MR];
      for (int r = 0; r < MR; ++r) {
        xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + 64 * p + 32 * h));
        xs[r] = _mm256_broadcast_ss(xd + r * groups + 2 * p + h);
      }
      for (int j = 0; j < NO; ++j) {
        const QPair& w = buf[j * kKB32 + p];
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.u + 32 * h));
        const __m256 ws = _mm256_broadcast_ss(w.ws + 8 * h);
        __m256i sg = _mm256_setzero_si256();
        if constexpr (S) sg = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.sg + 32 * h));
        for (int r = 0; r < MR; ++r) {
          const __m256i xr = S ? _mm256_sign_epi8(xv[r], sg) : xv[r];
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xr), ones);
          f[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, xs[r]), f[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < NO; ++j)
    for (int r = 0; r < MR; ++r) facc[j * nr + r] = f[j][r];
}
#endif

template <int NO, bool S>
inline void q_micro_rows(int mr, const QPair* buf, int64_t np, int64_t half_last, const int8_t* x,
                         int64_t k, const float* xd, int64_t groups, QAcc* facc, int64_t nr) {
  switch (mr) {
    case 1: return q_micro<NO, 1, S>(buf, np, half_last, x, k, xd, groups, facc, nr);
    case 2: if constexpr (kMR32 >= 2) return q_micro<NO, 2, S>(buf, np, half_last, x, k, xd, groups, facc, nr); break;
    case 3: if constexpr (kMR32 >= 3) return q_micro<NO, 3, S>(buf, np, half_last, x, k, xd, groups, facc, nr); break;
    case 4: if constexpr (kMR32 >= 4) return q_micro<NO, 4, S>(buf, np, half_last, x, k, xd, groups, facc, nr); break;
  }
}

constexpr int64_t kQTile = 64;

// a task's outputs [o0, o1) of a 32-value part over every row (k_task's loops, pairs of blocks)
template <int64_t T>
void q_task(const Q8Rows& X, int64_t m, int64_t k, int64_t n, float* y, int64_t row_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  constexpr bool S = T == Q8_0 && kQ8Signed;
  const int64_t groups = k / kQ, npairs = (groups + 1) / 2;
  thread_local std::vector<QPair> bufv(kNO32 * kKB32);
  thread_local std::vector<float> mnv;
  mnv.resize(kNO32 * groups + 1);
  QPair* buf = bufv.data();
  alignas(64) QAcc facc[kNO32 * kQTile];
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0;
    for (int64_t og = o0; og < o1; og += kNO32) {
      const int no = static_cast<int>(std::min<int64_t>(kNO32, o1 - og));
      for (int64_t i = 0; i < no * nr; ++i) facc[i] = qacc_zero();
      for (int64_t p0 = 0; p0 < npairs; p0 += kKB32) {
        const int64_t np = std::min(kKB32, npairs - p0);
        const int64_t half_last = (p0 + np == npairs) && (groups % 2);
        for (int j = 0; j < no; ++j) {
          const uint8_t* row = w + (og + j) * row_bytes;
          for (int64_t p = 0; p < np; ++p) {
            __builtin_prefetch(row + std::min((2 * (p0 + p) + 8) * B, row_bytes - 1));
            dec_pair<T>(row, p0 + p, groups, buf[j * kKB32 + p], mnv.data() + j * groups);
          }
        }
        for (int64_t rr = 0; rr < nr; rr += kMR32) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR32, nr - rr));
          const int64_t row = r0 + rr;
          const int8_t* x = X.q + row * k + p0 * 64;
          const float* xd = X.d + row * groups + 2 * p0;
          QAcc* f = facc + rr;
          switch (no) {
            case 1: q_micro_rows<1, S>(mr, buf, np, half_last, x, k, xd, groups, f, nr); break;
            case 2: if constexpr (kNO32 >= 2) q_micro_rows<2, S>(mr, buf, np, half_last, x, k, xd, groups, f, nr); break;
            case 3: if constexpr (kNO32 >= 3) q_micro_rows<3, S>(mr, buf, np, half_last, x, k, xd, groups, f, nr); break;
            case 4: if constexpr (kNO32 >= 4) q_micro_rows<4, S>(mr, buf, np, half_last, x, k, xd, groups, f, nr); break;
          }
        }
      }
      for (int j = 0; j < no; ++j)
        for (int64_t r = 0; r < nr; ++r)
          y[(r0 + r) * n + col0 + og + j] =
              qacc_sum(facc[j * nr + r]) + min_dot(mnv.data() + j * groups, X.s + (r0 + r) * groups, groups);
    }
  }
}
#endif

}  // namespace

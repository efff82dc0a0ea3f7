// ggml_linear / ggml_get_rows / ggml_dequantize: compute on a GGUF file's own quantized blocks
// (llama.cpp's block formats, as the file stores them: no repack, no dense float copy).
//
// Block formats (GGML type id: values per block, bytes per block; d, dmin, m: fp16):
//   Q4_0 (2):  32, 18   d, qs[16]                w = d * (q - 8)        q: nibbles (j: qs[j] low,
//   Q4_1 (3):  32, 20   d, m, qs[16]             w = d * q + m           16 + j: qs[j] high)
//   Q5_0 (6):  32, 22   d, qh[4], qs[16]         w = d * (q - 16)       5th bit: bit j of qh
//   Q5_1 (7):  32, 24   d, m, qh[4], qs[16]      w = d * q + m
//   Q8_0 (8):  32, 34   d, int8 qs[32]           w = d * q
//   Q4_K (12): 256, 144 d, dmin, scales[12], qs[128]   8 sub-blocks of 32 with a 6-bit scale
//              and min each: w = d * sc * q - dmin * mn; qs in chunks of 32 bytes, the low
//              nibbles sub-block 2c, the high ones 2c + 1
//   Q5_K (13): 256, 176 d, dmin, scales[12], qh[32], qs[128]: Q4_K plus bit s of qh[l] as the
//              5th bit of sub-block s's value l
//   Q6_K (14): 256, 210 ql[128], qh[64], int8 scales[16], d: w = d * scales[i / 16] * (q - 32)
//   F32 (0), F16 (1), BF16 (30): one value per "block".
//
// The integer paths (activations in int8, as llama.cpp's q8_0 / q8_K):
// - K-quants (Q4_K, Q5_K, Q6_K; every build; ggml_kquants.cpp): each activation row quantized
//   per 256 values, each super-block's sums exact in int32 with its integer scales, two float
//   operations per super-block and (output, row); register tiles with the outputs interleaved
//   into a vector's lanes (8 a vector, 16 with AVX-512 VNNI).
// - the 32-value kinds on AVX2 / AVX-512: rows per 32 values
//   (quantize_rows_q8, int4.cpp: d = max|x| / 127 and s = d * the sum of the int8 values),
//   unsigned decoded blocks (w = d * u + mn), the same register tiles (see "the 32-value kinds").
// - the portable build's 32-value kinds: rows_q below, in plain C++, per 32 values: each
//   weight block decoded into int8 values with a float scale per 16 values and, for the kinds
//   with a minimum (Q4_1, Q5_1), a float minimum per 32 (the offsets of Q4_0 / Q5_0 taken into
//   the signed values); per 32 values the dot product exact in int32 in 8 lanes of 4 values,
//   scaled in float32:
//   y[r, o] = sum_blocks sum_lanes scale[lane] * d_x[r, g] * dot + sum_g min[g] * s_x[r, g];
//   tiled: tasks of kOutBlock outputs (parallel); within a task, tiles of rows (sized so that
//   their int8 rows stay in L1), within those each output's blocks decoded once into L1 and
//   applied to every row of the tile.
// The float kinds take rows_q's tiling with a float row.
#include "ggml_formats.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace ggml;

constexpr int64_t kQ = 32;         // values per activation scale
constexpr int64_t kOutBlock = 16;  // outputs per task: their weights stay in L1/L2 over row tiles

// ---- the dequantized values (ggml_dequantize, ggml_get_rows, the float kinds' rows) ----------

// NOTE: no contraction into an FMA: the values must be gguf-py's (d * q, then + m) bit for bit.
template <int64_t T>
__attribute__((optimize("fp-contract=off"))) void dequant_row_q(const uint8_t* row, int64_t k,
                                                                float* out) {
  using F = Fmt<T>;
  alignas(64) int8_t q[F::E];
  float sc[F::E / 16], mn[F::E / 32 > 0 ? F::E / 32 : 1];
  for (int64_t b = 0; b < k / F::E; ++b) {
    F::decode(row + b * F::B, q, sc, mn);
    float* o = out + b * F::E;
    for (int64_t i = 0; i < F::E; ++i) {
      const float v = sc[i / 16] * static_cast<float>(q[i]);
      o[i] = F::kHasMin ? v + mn[i / 32] : v;
    }
  }
}

void dequant_row(int64_t type, const uint8_t* row, int64_t k, float* out) {
  switch (type) {
    case F32: std::memcpy(out, row, k * 4); return;
    case F16:
      for (int64_t i = 0; i < k; ++i) out[i] = fp16(row + 2 * i);
      return;
    case BF16:
      for (int64_t i = 0; i < k; ++i) out[i] = bf16(row + 2 * i);
      return;
    case Q4_0: return dequant_row_q<Q4_0>(row, k, out);
    case Q4_1: return dequant_row_q<Q4_1>(row, k, out);
    case Q5_0: return dequant_row_q<Q5_0>(row, k, out);
    case Q5_1: return dequant_row_q<Q5_1>(row, k, out);
    case Q8_0: return dequant_row_q<Q8_0>(row, k, out);
    case Q4_K: return dequant_row_q<Q4_K>(row, k, out);
    case Q5_K: return dequant_row_q<Q5_K>(row, k, out);
    case Q6_K: return dequant_row_q<Q6_K>(row, k, out);
    default: type_info(type);  // raises
  }
}

// ---- the integer kernels ------------------------------------------------------------------------

struct Task {
  int64_t part, o0, o1;  // outputs [o0, o1) of parts[part]
};

struct Linear {
  const Q8Rows* xq;    // the int8 rows (quantized kinds)
  const float* xf;     // the float32 rows (float kinds)
  int64_t m, k, n;     // rows, inputs, all outputs
  float* y;            // [m, n]
  int64_t row_tile;    // rows whose int8 values stay in L1 while a task's outputs pass
};

using Acc = float;  // 8 a row
// a row's 8 lanes and its minimums' term. Not inlined: under -ffast-math the compiler
// vectorized this sum across 4 rows of a tile in one order and summed a lone row in another,
// so a row's y depended on the rows beside it (the portable build only)
__attribute__((noinline)) float lanes_total(const float* a, float m) {
  float t = 0.f;
  for (int lane = 0; lane < 8; ++lane) t += a[lane];
  return t + m;
}

// portable C++: the same integers (8 lanes of 4 values a block of 32) and float32 scaling
template <int64_t T>
void rows_q(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
            Acc* acc, float* macc) {
  using F = Fmt<T>;
  constexpr int64_t S = F::E / kQ;
  const int64_t groups = L.k / kQ, nr = r1 - r0;
  alignas(64) int8_t q[F::E];
  float sc[F::E / 16], mn[S];
  for (int64_t r = 0; r < 8 * nr; ++r) acc[r] = 0.f;
  for (int64_t r = 0; r < nr; ++r) macc[r] = 0.f;
  for (int64_t b = 0; b < L.k / F::E; ++b) {
    F::decode(wrow + b * F::B, q, sc, mn);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * S;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const float* xd = L.xq->d + g0;
      float* a = acc + 8 * r;
      for (int64_t s = 0; s < S; ++s) {
        for (int lane = 0; lane < 8; ++lane) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i)
            dot += static_cast<int32_t>(q[s * kQ + 4 * lane + i]) * xr[s * kQ + 4 * lane + i];
          a[lane] += static_cast<float>(dot) * (sc[2 * s + lane / 4] * xd[s]);
        }
      }
      if constexpr (F::kHasMin) {
        const float* xs = L.xq->s + g0;
        for (int64_t s = 0; s < S; ++s) macc[r] += mn[s] * xs[s];
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = lanes_total(acc + 8 * r, macc[r]);
}

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

// one block -> u, d, mn
template <int64_t T>
inline __m256i dec32(const uint8_t* b, float& d, float& mn) {
  if constexpr (T == Q4_0) {
    d = fp16(b), mn = -8.f * d;
    return nib32(b + 2);
  } else if constexpr (T == Q4_1) {
    d = fp16(b), mn = fp16(b + 2);
    return nib32(b + 4);
  } else if constexpr (T == Q5_0) {
    d = fp16(b), mn = -16.f * d;
    return _mm256_or_si256(nib32(b + 6), bit5(b + 2));
  } else if constexpr (T == Q5_1) {
    d = fp16(b), mn = fp16(b + 2);
    return _mm256_or_si256(nib32(b + 8), bit5(b + 4));
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

// a float part's output o over rows [r0, r1): its row dequantized once into wf
void rows_f(const Linear& L, int64_t type, const uint8_t* wrow, int64_t r0, int64_t r1,
            float* y_col, float* wf) {
  dequant_row(type, wrow, L.k, wf);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = L.xf + r * L.k;
    float acc = 0.f;
    for (int64_t i = 0; i < L.k; ++i) acc += xr[i] * wf[i];
    y_col[r * L.n] = acc;
  }
}

void run_task(const Linear& L, int64_t type, const uint8_t* w, int64_t row_bytes, int64_t o0,
              int64_t o1, int64_t col0) {
  thread_local std::vector<float> accbuf, macc, wf;  // up to 16 lanes a row, 64-byte aligned
  accbuf.resize(16 * L.row_tile + 16);
  const auto at = reinterpret_cast<uintptr_t>(accbuf.data());
  auto* acc = reinterpret_cast<Acc*>((at + 63) & ~uintptr_t{63});
  macc.resize(L.row_tile);
  if (!type_info(type).quantized) wf.resize(L.k);
  for (int64_t r0 = 0; r0 < L.m; r0 += L.row_tile) {
    const int64_t r1 = std::min(L.m, r0 + L.row_tile);
    for (int64_t o = o0; o < o1; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      float* y_col = L.y + col0 + o;
      switch (type) {
        case Q4_0: rows_q<Q4_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q4_1: rows_q<Q4_1>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q5_0: rows_q<Q5_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q5_1: rows_q<Q5_1>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q8_0: rows_q<Q8_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        default: rows_f(L, type, wrow, r0, r1, y_col, wf.data());
      }
    }
  }
}

void check_weight(const at::Tensor& w, int64_t type, int64_t k, const char* what) {
  const TypeInfo t = type_info(type);
  TORCH_CHECK_VALUE(k > 0 && k % t.elems == 0, what, ": k = ", k, " is not a multiple of ",
                    t.elems, " (GGML type ", type, "'s block)");
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), what,
                    ": weights must be a contiguous [n, row_bytes] uint8 tensor, got ",
                    w.scalar_type(), " ", w.sizes());
  TORCH_CHECK_VALUE(w.size(1) == k / t.elems * t.bytes, what, ": rows of ", w.size(1),
                    " bytes, but GGML type ", type, " stores ", k, " values in ",
                    k / t.elems * t.bytes);
}

}  // namespace

int64_t ggml_row_bytes(int64_t type, int64_t k) {
  const TypeInfo t = type_info(type);
  TORCH_CHECK_VALUE(k >= 0 && k % t.elems == 0, "ggml_row_bytes: k = ", k,
                    " is not a multiple of ", t.elems, " (GGML type ", type, "'s block)");
  return k / t.elems * t.bytes;
}

at::Tensor ggml_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& types, int64_t k) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat ||
                                        x_in.scalar_type() == at::kBFloat16),
                    "ggml_linear: x must be [m, k] float32 or bfloat16, got ", x_in.scalar_type(),
                    " ", x_in.sizes());
  TORCH_CHECK_VALUE(x_in.size(1) == k, "ggml_linear: x has ", x_in.size(1), " columns, k = ", k);
  TORCH_CHECK_VALUE(!parts.empty() && parts.size() == types.size(), "ggml_linear: ",
                    parts.size(), " parts and ", types.size(), " types");
  bool any_q = false, any_k = false, any_f = false;
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_weight(parts[i], types[i], k, "ggml_linear");
    (is_k(types[i]) ? any_k : type_info(types[i]).quantized ? any_q : any_f) = true;
    n += parts[i].size(0);
  }
  const int64_t m = x_in.size(0);
  // bfloat16 rows (the AVX-512 BF16 path's activations) in and out through plain loops: a
  // torch conversion of a verification step's 17 x 8960 outputs is a parallel region of its
  // own, ~12% of a speculative step in a profile on a busy 2-core Zen 4
  const bool bf16_io = x_in.scalar_type() == at::kBFloat16;
  at::Tensor x;
  if (x_in.scalar_type() == at::kFloat) {
    x = x_in.contiguous();
  } else if (bf16_io) {
    const at::Tensor xb = x_in.contiguous();
    x = at::empty({m, k}, xb.options().dtype(at::kFloat));
    const at::BFloat16* src = xb.data_ptr<at::BFloat16>();
    float* dst = x.data_ptr<float>();
    for (int64_t i = 0; i < m * k; ++i) dst[i] = to_float(src[i]);
  } else {
    x = x_in.to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
  at::Tensor out = bf16_io ? at::empty({m, n}, x_in.options()) : y;
  const bool direct = x_in.scalar_type() == at::kFloat || bf16_io;  // else: y converted at the end
  if (m == 0 || n == 0) return direct ? out : y.to(x_in.scalar_type());
  TORCH_CHECK_VALUE(!any_q || k % kQ == 0, "ggml_linear: k must be a multiple of 32");
  Q8Rows rows{nullptr, nullptr, nullptr};
  if (any_q) rows = quantize_rows(x);
  Q8K krows{nullptr, nullptr, nullptr, nullptr};
  if (any_k) krows = quantize_rows_k(x.data_ptr<float>(), m, k);
  // rows per tile: their int8 values (k bytes a row) within ~32 KB of L1
  const int64_t row_tile = std::clamp<int64_t>(32768 / k, 4, 64);
  const int64_t k_tile = k_tile_rows(k);
#if defined(CELLSERVE_GGML_TILE32)
  const int64_t q_tile = std::max<int64_t>(kMR32, std::min<int64_t>(kQTile, 32768 / k) / kMR32 * kMR32);
#endif
  const Linear L{&rows, any_f ? x.data_ptr<float>() : nullptr, m, k, n, y.data_ptr<float>(),
                 row_tile};
  std::vector<Task> tasks;
  std::vector<int64_t> col0(parts.size());
  for (size_t i = 0, c = 0; i < parts.size(); c += parts[i].size(0), ++i) {
    col0[i] = static_cast<int64_t>(c);
    for (int64_t o = 0; o < parts[i].size(0); o += kOutBlock)
      tasks.push_back({static_cast<int64_t>(i), o, std::min(parts[i].size(0), o + kOutBlock)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const at::Tensor& w = parts[task.part];
      const int64_t type = types[task.part];
      const uint8_t* wp = w.data_ptr<uint8_t>();
      const int64_t c0 = col0[task.part];
      float* yp = L.y;
      switch (type) {
        case Q4_K:
        case Q5_K:
        case Q6_K: k_part(type, krows, m, k, n, yp, k_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#if defined(CELLSERVE_GGML_TILE32)
        case Q4_0: q_task<Q4_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q4_1: q_task<Q4_1>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_0: q_task<Q5_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_1: q_task<Q5_1>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q8_0: q_task<Q8_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#endif
        default: run_task(L, type, wp, w.size(1), task.o0, task.o1, c0);
      }
      if (bf16_io) {  // this task's outputs, while they are in cache
        at::BFloat16* ob = out.data_ptr<at::BFloat16>();
        for (int64_t r = 0; r < m; ++r)
          to_bf16(yp + r * n + c0 + task.o0, ob + r * n + c0 + task.o0, task.o1 - task.o0);
      }
    }
  });
  return direct ? out : y.to(x_in.scalar_type());
}

at::Tensor ggml_get_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids_in, int64_t k) {
  check_weight(w, type, k, "ggml_get_rows");
  TORCH_CHECK_VALUE(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong,
                    "ggml_get_rows: ids must be a 1-D int64 tensor");
  const auto ids = ids_in.contiguous();
  const int64_t m = ids.size(0), n = w.size(0), row_bytes = w.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < n, "ggml_get_rows: id ", ip[i], " out of [0, ", n,
                      ")");
  auto out = at::empty({m, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row(type, wp + ip[i] * row_bytes, k, op + i * k);
  });
  return out;
}

at::Tensor ggml_dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  check_weight(w, type, k, "ggml_dequantize");
  const int64_t n = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row(type, wp + i * row_bytes, k, op + i * k);
  });
  return out;
}

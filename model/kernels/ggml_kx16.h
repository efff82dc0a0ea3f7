// Q4_K repacked 16 outputs at a time (the AVX-512 VNNI build): the K-quant tiles without the
// interleave a call. Included by ggml_kquants.cpp only (after ggml_ktiles.h: bcast4z).
//
// The tiles (ggml_ktiles.h) interleave 16 outputs' super-blocks into a KCol16 every call: at a
// few rows that interleave (decode, then dword transposes) costs more than the rows' vpdpbusd,
// and a step of 8 rows through the 1.5B's linears took ~2.8x the one-row step. Here the same
// interleave is done once, at load, and without decoding: a group of 16 outputs' rows (16 *
// row_bytes bytes, contiguous, as any 16 rows are) holds per super-block b, at b * 2304:
//   [0, 32)     the 16 outputs' d (fp16), output o at 2o
//   [32, 64)    their dmin (fp16)
//   [64, 256)   their 12 scale bytes as 3 dwords: dword j of output o at 64 + 64j + 4o
//   [256, 2304) their qs as 32 chunks of 64 bytes: chunk c holds output o's qs[4c .. 4c + 3]
//               at 4o (low nibbles: values 64(c / 8) + 4(c % 8) + i, high nibbles 32 later)
// The same 144 bytes an output a super-block, moved (ggml_repack_q4k). A chunk's low (high)
// nibbles are one vpdpbusd operand for 4 values of 16 outputs; the scales decode in the lanes
// (k_scale_words' operations on 16 dwords at once). The sums are the tiles' exact integers (per
// 32 values the dot products times the 6-bit scale; the minimums times the row's sums per 16)
// and the same two float operations per super-block, output and row, in the same order: the
// bits of the tiles and of k_gemv on the file's layout.
#pragma once

#include "ggml_kdecode.h"

namespace ggml {
namespace {

#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
#define CELLSERVE_GGML_X16 1
constexpr int64_t kX16Bytes = 16 * 144;  // a group's super-block
constexpr int kX16Rows = 8;               // rows a micro-kernel

// rows [0, MR) (x: row 0's int8 values, rows k apart; xd, xs: its d and s16, rows nb and k / 16
// apart) times the group at g over nb super-blocks -> y (row r's 16 outputs at y + r * n)
template <int MR>
__attribute__((noinline)) void x16_micro(const uint8_t* g, int64_t nb, const int8_t* x, int64_t k,
                                         const float* xd, const int16_t* xs, float* y, int64_t n) {
  const __m512i m3f = _mm512_set1_epi32(0x3f3f3f3f), m0f = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i m30 = _mm512_set1_epi32(0x30303030), ff = _mm512_set1_epi32(0xff);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 f[MR];
  for (int r = 0; r < MR; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* s = g + b * kX16Bytes;
    const int8_t* xb = x + 256 * b;
    // k_scale_words in the lanes: w[0] scales 0-3, w[1] 4-7, w[2] minimums 0-3, w[3] 4-7
    const __m512i a = _mm512_loadu_si512(s + 64), bq = _mm512_loadu_si512(s + 128);
    const __m512i c = _mm512_loadu_si512(s + 192);
    __m512i w[4];
    w[0] = _mm512_and_si512(a, m3f);
    w[1] = _mm512_or_si512(_mm512_and_si512(c, m0f), _mm512_and_si512(_mm512_srli_epi32(a, 2), m30));
    w[2] = _mm512_and_si512(bq, m3f);
    w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), m0f),
                           _mm512_and_si512(_mm512_srli_epi32(bq, 2), m30));
    const uint8_t* q = s + 256;
    __m512i acc[MR], t[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int sb = 0; sb < 8; ++sb) {  // sub-block sb: values 32 sb .. 32 sb + 31
      const int j = sb / 2, h = sb % 2;
      for (int r = 0; r < MR; ++r) t[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int l4 = 0; l4 < 8; ++l4) {
        const __m512i p = _mm512_loadu_si512(q + 64 * (8 * j + l4));
        const __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(p, 4) : p, low4);
        const int8_t* xv = xb + 32 * sb + 4 * l4;
        for (int r = 0; r < MR; ++r) t[r] = _mm512_dpbusd_epi32(t[r], u, bcast4z(xv + r * k));
      }
      const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(w[sb / 4], 8 * (sb % 4)), ff);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_add_epi32(acc[r], _mm512_mullo_epi32(t[r], sc));
    }
    // the minimums: sub-block sb's, as the pair (m, m), times the row's sums of its two 16s
#pragma GCC unroll 8
    for (int sb = 0; sb < 8; ++sb) {
      const __m512i m = _mm512_and_si512(_mm512_srli_epi32(w[2 + sb / 4], 8 * (sb % 4)), ff);
      const __m512i mm = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
      for (int r = 0; r < MR; ++r)
        t[r] = _mm512_dpwssd_epi32(sb == 0 ? _mm512_setzero_si512() : t[r], mm,
                                   bcast4z(xs + r * (k / 16) + 16 * b + 2 * sb));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, dx), f[r]);
      f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(dm, dx), f[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * n, f[r]);
}

template <int MR = kX16Rows>
void x16_rows(int mr, const uint8_t* g, int64_t nb, const int8_t* x, int64_t k, const float* xd,
              const int16_t* xs, float* y, int64_t n) {
  if constexpr (MR > 1)
    if (mr < MR) return x16_rows<MR - 1>(mr, g, nb, x, k, xd, xs, y, n);
  x16_micro<MR>(g, nb, x, k, xd, xs, y, n);
}

// outputs [o0, o1) (multiples of 16) of a repacked Q4_K part for every row of X
inline void x16_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, const uint8_t* w,
                     int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  const int64_t nb = k / 256;
  for (int64_t og = o0; og < o1; og += 16) {
    const uint8_t* g = w + og * row_bytes;
    for (int64_t r = 0; r < m; r += kX16Rows)
      x16_rows(static_cast<int>(std::min<int64_t>(kX16Rows, m - r)), g, nb, X.q + r * k, k,
               X.d + r * nb, X.s16 + r * (k / 16), y + r * n + col0 + og, n);
  }
}
#endif

}  // namespace
}  // namespace ggml

// Q4_K repacked G outputs a group at load (G = 16 with AVX-512 VNNI, 8 on the other AVX2 and
// AVX-512 builds): the K-quant tiles without the interleave a call. Included by
// ggml_kquants.cpp only (after ggml_ktiles.h: bcast4, bcast4z).
//
// The tiles (ggml_ktiles.h) interleave a column's super-blocks into a KCol / KCol16 every call:
// at a few rows that interleave (decode, then dword transposes) costs more than the rows' sums,
// and a step of 8 rows through the 1.5B's linears took ~2.8x the one-row step. Here the same
// interleave is done once, at load, and without decoding: a group of G outputs' rows (G *
// row_bytes bytes, contiguous, as any G rows are) holds per super-block b, at b * G * 144:
//   [0, 2G)       the G outputs' d (fp16), output o at 2o
//   [2G, 4G)      their dmin (fp16)
//   [4G, 16G)     their 12 scale bytes as 3 dwords: dword j of output o at 4G + 4G j + 4o
//   [16G, 144G)   their qs as 32 chunks of 4G bytes: chunk c holds output o's qs[4c .. 4c + 3]
//                 at 4o (low nibbles: values 64(c / 8) + 4(c % 8) + i, high nibbles 32 later)
// The same 144 bytes an output a super-block, moved (repack_q4k). A chunk's low (high) nibbles
// are one vpdpbusd (vpmaddubsw) operand for 4 values of G outputs; the scales decode in the lanes
// (k_scale_words' operations on G dwords at once). The sums are the tiles' exact integers (per
// 32 values the dot products, in int16 with vpmaddubsw as the AVX2 tiles sum them, times the
// 6-bit scale; the minimums times the row's sums per 16) and the same two float operations per
// super-block, output and row, in the same order: the bits of the tiles and of k_gemv on the
// file's layout, at every row count.
#pragma once

#include "ggml_kdecode.h"

namespace ggml {
namespace {

#if defined(CELLSERVE_GGML_KCOL)
#define CELLSERVE_GGML_REPACK 1
#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
constexpr int64_t kRepackLanes = 16;
constexpr int kRepackRows = 8;  // rows a micro-kernel
constexpr int64_t kRepackType = Q4_K_X16;
constexpr int64_t kX16Bytes = 16 * 144;  // a group's super-block

// k_scale_words in the 16 lanes of a group's super-block at s: w[0] scales 0-3, w[1] 4-7, w[2]
// minimums 0-3, w[3] 4-7 (a byte each)
inline void scale_words16(const uint8_t* s, __m512i* w) {
  const __m512i m3f = _mm512_set1_epi32(0x3f3f3f3f), m0f = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i m30 = _mm512_set1_epi32(0x30303030);
  const __m512i a = _mm512_loadu_si512(s + 64), bq = _mm512_loadu_si512(s + 128);
  const __m512i c = _mm512_loadu_si512(s + 192);
  w[0] = _mm512_and_si512(a, m3f);
  w[1] = _mm512_or_si512(_mm512_and_si512(c, m0f), _mm512_and_si512(_mm512_srli_epi32(a, 2), m30));
  w[2] = _mm512_and_si512(bq, m3f);
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), m0f),
                         _mm512_and_si512(_mm512_srli_epi32(bq, 2), m30));
}

// The minimums of sub-blocks 2p and 2p + 1 as one int16 pair (m_2p, m_2p+1) per lane, from
// scale words w[2], w[3] (bytes 2(p % 2) and 2(p % 2) + 1 of w[2 + p / 2]): one vpdpwssd with the
// row's pair of 32-value sums (Q8K::s32) adds both products, where a pair (m, m) against the two
// 16-value sums took one instruction a sub-block. The same integers: 8 -> 4 instructions a row
// and super-block (x16_micro at 8 rows in L1: ~160 -> ~172 GMAC/s a core on the Zen 4).
inline __m512i min_pair16(const __m512i* w, int p) {
  const __m512i sh = _mm512_srli_epi32(w[2 + p / 2], 16 * (p % 2));
  return _mm512_or_si512(_mm512_and_si512(sh, _mm512_set1_epi32(0xff)),
                         _mm512_and_si512(_mm512_slli_epi32(sh, 8), _mm512_set1_epi32(0x00ff0000)));
}

// rows [0, MR) (x: row 0's int8 values, rows k apart; xd, xs: its d and s32, rows nb and k / 32
// apart) times the group at g over nb super-blocks -> y (row r's 16 outputs at y + r * n; the
// running sums stay in y, which frees MR registers of the 32 for the integer sums)
template <int MR>
__attribute__((noinline)) void x16_micro(const uint8_t* g, int64_t nb, const int8_t* x, int64_t k,
                                         const float* xd, const int16_t* xs, float* y, int64_t n) {
  const __m512i ff = _mm512_set1_epi32(0xff), low4 = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * n, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* s = g + b * kX16Bytes;
    const int8_t* xb = x + 256 * b;
    __m512i w[4];
    scale_words16(s, w);
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
    // the minimums: sub-blocks 2p, 2p + 1's pair times the row's sums of those two 32s
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i mm = min_pair16(w, p);
      for (int r = 0; r < MR; ++r)
        t[r] = _mm512_dpwssd_epi32(p == 0 ? _mm512_setzero_si512() : t[r], mm,
                                   bcast4z(xs + r * (k / 32) + 8 * b + 2 * p));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
      __m512 f = _mm512_loadu_ps(y + r * n);
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, dx), f);
      f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(dm, dx), f);
      _mm512_storeu_ps(y + r * n, f);
    }
  }
}

#else
constexpr int64_t kRepackLanes = 8;
constexpr int kRepackRows = 4;  // 16 ymm registers: the int16 sums, the int32 sums, the floats
constexpr int64_t kRepackType = Q4_K_X8;
constexpr int64_t kX8Bytes = 8 * 144;

// k_scale_words in the 8 lanes of a group's super-block at s: w[0] scales 0-3, w[1] 4-7, w[2]
// minimums 0-3, w[3] 4-7 (a byte each)
inline void scale_words8(const uint8_t* s, __m256i* w) {
  const __m256i m3f = _mm256_set1_epi32(0x3f3f3f3f), m0f = _mm256_set1_epi32(0x0f0f0f0f);
  const __m256i m30 = _mm256_set1_epi32(0x30303030);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
  const __m256i bq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
  w[0] = _mm256_and_si256(a, m3f);
  w[1] = _mm256_or_si256(_mm256_and_si256(c, m0f), _mm256_and_si256(_mm256_srli_epi32(a, 2), m30));
  w[2] = _mm256_and_si256(bq, m3f);
  w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), m0f),
                         _mm256_and_si256(_mm256_srli_epi32(bq, 2), m30));
}

// min_pair16 in the 8 lanes of a group (scale words of scale_words8)
inline __m256i min_pair8(const __m256i* w, int p) {
  const __m256i sh = _mm256_srli_epi32(w[2 + p / 2], 16 * (p % 2));
  return _mm256_or_si256(_mm256_and_si256(sh, _mm256_set1_epi32(0xff)),
                         _mm256_and_si256(_mm256_slli_epi32(sh, 8), _mm256_set1_epi32(0x00ff0000)));
}

// x16_micro's sums with vpmaddubsw: a sub-block's 8 groups of 4 values summed in int16 (8 * 2 *
// 15 * 127 < 2^15, as the AVX2 tiles sum them), then times the pair (sc, sc) by vpmaddwd; xs is
// the rows' s32 (k / 32 apart), as for x16_micro
template <int MR>
__attribute__((noinline)) void x8_micro(const uint8_t* g, int64_t nb, const int8_t* x, int64_t k,
                                        const float* xd, const int16_t* xs, float* y, int64_t n) {
  const __m256i ff = _mm256_set1_epi32(0xff), low4 = _mm256_set1_epi8(0x0F);
  __m256 f[MR];
  for (int r = 0; r < MR; ++r) f[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* s = g + b * kX8Bytes;
    const int8_t* xb = x + 256 * b;
    __m256i w[4];
    scale_words8(s, w);
    const uint8_t* q = s + 128;
    __m256i acc[MR], t[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int sb = 0; sb < 8; ++sb) {
      const int j = sb / 2, h = sb % 2;
#pragma GCC unroll 8
      for (int l4 = 0; l4 < 8; ++l4) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (8 * j + l4)));
        const __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(p, 4) : p, low4);
        const int8_t* xv = xb + 32 * sb + 4 * l4;
        for (int r = 0; r < MR; ++r) {
          const __m256i prod = _mm256_maddubs_epi16(u, bcast4(xv + r * k));
          t[r] = l4 == 0 ? prod : _mm256_add_epi16(t[r], prod);
        }
      }
      const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(w[sb / 4], 8 * (sb % 4)), ff);
      const __m256i scp = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(t[r], scp));
    }
    // the minimums as x16_micro takes them: a pair of sub-blocks a vpmaddwd
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i mm = min_pair8(w, p);
      for (int r = 0; r < MR; ++r) {
        const __m256i prod = _mm256_madd_epi16(mm, bcast4(xs + r * (k / 32) + 8 * b + 2 * p));
        t[r] = p == 0 ? prod : _mm256_add_epi32(t[r], prod);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
    for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
      f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(d, dx), f[r]);
      f[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(t[r]), _mm256_mul_ps(dm, dx), f[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * n, f[r]);
}

// a repacked group's super-block at s -> the AVX2 tiles' KCol, the values pack_kcol gives from
// the file's blocks: per 4 values g the 8 outputs' 4 bytes, per 16 values the scale pair (sc,
// sc) of its 32, per pair of 16s the minimums' pair (m, m), d and dmin
inline void kcol_from_x8(const uint8_t* s, KCol& col) {
  const __m256i ff = _mm256_set1_epi32(0xff), low4 = _mm256_set1_epi8(0x0F);
  auto store = [](void* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); };
  const uint8_t* q = s + 128;
  for (int c = 0; c < 32; ++c) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    const int g = 16 * (c / 8) + c % 8;
    store(col.u[g], _mm256_and_si256(p, low4));
    store(col.u[g + 8], _mm256_and_si256(_mm256_srli_epi16(p, 4), low4));
  }
  __m256i w[4];
  scale_words8(s, w);
  for (int sb = 0; sb < 8; ++sb) {
    const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(w[sb / 4], 8 * (sb % 4)), ff);
    const __m256i scp = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
    store(col.sc[2 * sb], scp);
    store(col.sc[2 * sb + 1], scp);
    const __m256i m = _mm256_and_si256(_mm256_srli_epi32(w[2 + sb / 4], 8 * (sb % 4)), ff);
    store(col.mn[sb], _mm256_or_si256(m, _mm256_slli_epi32(m, 16)));
  }
  _mm256_store_ps(col.d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
  _mm256_store_ps(col.dm, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16))));
}

// the AVX2 tiles on repacked groups (k_task's column at og: the group's super-blocks 8 * 144
// bytes apart)
struct Tile8R : Tile8 {
  static constexpr int64_t kGroupStride = 8;
  template <int64_t T>
  static void pack(const uint8_t* s, int64_t, int, Col& col) {
    kcol_from_x8(s, col);
  }
};
#endif

template <int MR = kRepackRows>
void repacked_rows(int mr, const uint8_t* g, int64_t nb, const int8_t* x, int64_t k,
                   const float* xd, const int16_t* xs, float* y, int64_t n) {
  if constexpr (MR > 1)
    if (mr < MR) return repacked_rows<MR - 1>(mr, g, nb, x, k, xd, xs, y, n);
#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
  x16_micro<MR>(g, nb, x, k, xd, xs, y, n);
#else
  x8_micro<MR>(g, nb, x, k, xd, xs, y, n);
#endif
}

// outputs [o0, o1) (multiples of kRepackLanes) of a repacked Q4_K part for every row of X
inline void repacked_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, const uint8_t* w,
                          int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  const int64_t nb = k / 256;
  for (int64_t og = o0; og < o1; og += kRepackLanes) {
    const uint8_t* g = w + og * row_bytes;
    for (int64_t r = 0; r < m; r += kRepackRows)
      repacked_rows(static_cast<int>(std::min<int64_t>(kRepackRows, m - r)), g, nb, X.q + r * k, k,
                    X.d + r * nb, X.s32 + r * (k / 32), y + r * n + col0 + og, n);
  }
}
#endif

}  // namespace
}  // namespace ggml

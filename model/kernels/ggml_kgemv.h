// The K-quants at a few rows (k_gemv): each super-block decoded once in registers and summed
// with every row, the same integers and roundings as the tiles. Included by ggml_kquants.cpp only.
#pragma once

#include "ggml_kdecode.h"

namespace ggml {
namespace {

#if defined(CELLSERVE_GGML_KCOL)
// A super-block decoded once for every row of a small batch (KDec), then its two integer sums
// with a Q8K row (k_block_sums; x: the row's int8 values there, xs: its s16 there) as vectors
// whose lanes add up to them: ia to sum_i sc[i] * dot16(u_i, x_i), im to sum_i mn[i] * s16[i]
#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
// VNNI: per 64 values one vpdpbusd (int32 lane L: values 4L .. 4L + 3), two 64s' lanes packed to
// int16 (exact: 4 * 63 * 127 < 2^15) and one vpdpwssd by the scales in that order (scv), the
// 512-bit sum folded to 256 bits: 7 vector instructions a block and row, the decoding and the
// scales' permutation once a block (a super-block's values in 4 zmm of 64: Q4_K and Q6_K decoded
// at 512 bits, Q5_K through dec_k_regs; the header through the AVX2 decoders)
template <int64_t T>
inline void dec_k_zmm(const uint8_t* blk, __m512i* u, KRegs& r) {
  if constexpr (T == Q4_K) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h) {  // 64 bytes: the low nibbles of 2 chunks, then the high ones
      const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
      u[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
    }
    k_header_regs(blk, r);
  } else if constexpr (T == Q6_K) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {  // ql's 64 bytes with qh's 2-bit pairs 0 and 1, then 2 and 3
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      // pair 0 / 1 shifted up to bits 4, 5, pair 2 / 3 already there, masked (dec_k_regs<Q6_K>)
      u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), bits45));
      u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(hb, bits45));
    }
    r.sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    r.mn = r.sc;
    r.d = fp16(blk + 208);
    r.dm = 32.f * r.d;
  } else {
    dec_k_regs<T>(blk, r);
    for (int c = 0; c < 4; ++c) u[c] = _mm512_inserti64x4(_mm512_castsi256_si512(r.u[2 * c]), r.u[2 * c + 1], 1);
  }
}

struct KDec {
  __m512i u[4];
  __m512i scv[2];  // the scales of the int16 lanes of the 64s 2h and 2h + 1 packed (h = 0, 1)
  __m256i mn;
  float d, dm;
};

template <int64_t T>
inline void k_dec(const uint8_t* blk, KDec& D) {
  KRegs r;
  dec_k_zmm<T>(blk, D.u, r);
  // vpackssdw of the 64s 2h and 2h + 1 (per 128 bits c: 4 lanes of each): int16 lane 8c + e
  // holds the 16 8h + c (e < 4) or 8h + 4 + c (e >= 4), whose scale the pair of lanes takes
  const __m512i q = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17,
                                     16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i e4 = _mm512_and_si512(_mm512_srli_epi16(q, 2), _mm512_set1_epi16(1));  // e >= 4
  const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(q, 3), _mm512_slli_epi16(e4, 2));
  const __m512i sc = _mm512_castsi256_si512(r.sc);
  D.scv[0] = _mm512_permutexvar_epi16(idx, sc);
  D.scv[1] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(8)), sc);
  D.mn = r.mn;
  D.d = r.d;
  D.dm = r.dm;
}

inline void k_block_sums(const KDec& D, const int8_t* x, const int16_t* xs, __m256i& ia, __m256i& im) {
  __m512i acc = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), D.u[2 * h], _mm512_loadu_si512(x + 128 * h));
    const __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), D.u[2 * h + 1], _mm512_loadu_si512(x + 128 * h + 64));
    acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(t0, t1), D.scv[h]);
  }
  ia = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  im = _mm256_madd_epi16(D.mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
}
#else
// (vpmaddubsw, vpmaddwd by the scale of each 16, in the block's own order)
struct KDec {
  KRegs r;
  __m256i s[8];  // the scales of the 16s 2i and 2i + 1 in int16 lanes 0-7 and 8-15
  float d, dm;
};

template <int64_t T>
inline void k_dec(const uint8_t* blk, KDec& D) {
  dec_k_regs<T>(blk, D.r);
  D.d = D.r.d;
  D.dm = D.r.dm;
  // one byte shuffle of a half of sc held in both lanes (a store and 16 scalar broadcasts
  // before: ~10% of a decode step)
  const __m256i halves[2] = {_mm256_permute2x128_si256(D.r.sc, D.r.sc, 0x00),
                             _mm256_permute2x128_si256(D.r.sc, D.r.sc, 0x11)};
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const int j = 4 * (i % 4);  // byte of sc[2i] within its half
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((j + 3) << 8) | (j + 2))),
                                          _mm_set1_epi16(static_cast<int16_t>(((j + 1) << 8) | j)));
    D.s[i] = _mm256_shuffle_epi8(halves[i / 4], pick);
  }
}

inline void k_block_sums(const KDec& D, const int8_t* x, const int16_t* xs, __m256i& ia, __m256i& im) {
  ia = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i));
    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(D.r.u[i], xv), D.s[i]));
  }
  im = _mm256_madd_epi16(D.r.mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
}
#endif

// A few rows (a decode step's one, a short speculative verification): an output at a time along
// its row (one stream for the prefetcher), two super-blocks at a time, each decoded in registers
// once (no interleaving) and summed with each row's values (k_block_sums), a row's four sums
// reduced into the lanes of one vector, then k_micro's float operations in scalar form, block by
// block: the same integers and the same roundings as a lane of the tiles. x rows k apart, y rows n.
//
// One row (a decode step): two outputs at a time, a super-block of each a step, their four sums
// reduced in one vector as above: the two outputs' chains of decoding, sums and scalar FMAs are
// independent, so they overlap (one output at a time left the core waiting on each chain: ~18.5
// GB/s a thread on Q6_K in cache with VNNI, below what two threads read from memory; the AVX2
// build's one-row Q6_K 0.73-0.82x with pairs, Zen 4 forced AVX2). Each output's operations and
// their order are unchanged: the same bits.
template <int64_t T>
void k_gemv_pairs(const Q8K& X, int64_t k, float* y, const uint8_t* w, int64_t row_bytes, int64_t o0,
                  int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  for (int64_t o = o0; o < o1; o += 2) {
    const uint8_t* ra = w + o * row_bytes;
    const uint8_t* rb = ra + row_bytes;
    float fa = 0.f, fb = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      // the next pair's two rows, at the rate this pair's are read
      for (int64_t l = 0; l < 2 * B; l += 64) __builtin_prefetch(ra + 2 * row_bytes + 2 * B * b + l);
      KDec Da, Db;
      k_dec<T>(ra + b * B, Da);
      k_dec<T>(rb + b * B, Db);
      const int8_t* xq = X.q + 256 * b;
      const int16_t* xs = X.s16 + 16 * b;
      __m256i iaa, ima, iab, imb;
      k_block_sums(Da, xq, xs, iaa, ima);
      k_block_sums(Db, xq, xs, iab, imb);
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(iaa, ima), _mm256_hadd_epi32(iab, imb));
      const __m128 v = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
      const float dx = X.d[b];
      fa = std::fma(_mm_cvtss_f32(v), Da.d * dx, fa);
      fa = std::fma(-_mm_cvtss_f32(_mm_movehdup_ps(v)), Da.dm * dx, fa);
      fb = std::fma(_mm_cvtss_f32(_mm_movehl_ps(v, v)), Db.d * dx, fb);
      fb = std::fma(-_mm_cvtss_f32(_mm_shuffle_ps(v, v, 3)), Db.dm * dx, fb);
    }
    y[col0 + o] = fa;
    y[col0 + o + 1] = fb;
  }
}

template <int64_t T, int R>
void k_gemv(const Q8K& X, int64_t k, int64_t n, float* y, const uint8_t* w, int64_t row_bytes,
            int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  if constexpr (R == 1) {
    const int64_t even = o0 + (o1 - o0) / 2 * 2;
    k_gemv_pairs<T>(X, k, y, w, row_bytes, o0, even, col0);
    o0 = even;  // the odd one out: below
  }
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    float f[R] = {};
    for (int64_t b = 0; b < nb; b += 2) {
      const uint8_t* blk = row + b * B;
      for (int64_t l = 0; l < 2 * B; l += 64) __builtin_prefetch(blk + 16 * B + l);
      const bool two = b + 1 < nb;
      KDec D0, D1;
      k_dec<T>(blk, D0);
      if (two) k_dec<T>(blk + B, D1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = X.q + r * k + 256 * b;
        const int16_t* xs = X.s16 + r * (k / 16) + 16 * b;
        __m256i ia0, im0, ia1 = _mm256_setzero_si256(), im1 = _mm256_setzero_si256();
        k_block_sums(D0, xq, xs, ia0, im0);
        if (two) k_block_sums(D1, xq + 256, xs + 16, ia1, im1);
        // [ia0, im0, ia1, im1] summed: the lanes' pairs, then the halves
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(ia0, im0), _mm256_hadd_epi32(ia1, im1));
        const __m128 v = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        const float dx0 = X.d[r * nb + b];
        f[r] = std::fma(_mm_cvtss_f32(v), D0.d * dx0, f[r]);
        f[r] = std::fma(-_mm_cvtss_f32(_mm_movehdup_ps(v)), D0.dm * dx0, f[r]);
        if (two) {
          const float dx1 = X.d[r * nb + b + 1];
          f[r] = std::fma(_mm_cvtss_f32(_mm_movehl_ps(v, v)), D1.d * dx1, f[r]);
          f[r] = std::fma(-_mm_cvtss_f32(_mm_shuffle_ps(v, v, 3)), D1.dm * dx1, f[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * n + col0 + o] = f[r];
  }
}
#endif  // CELLSERVE_GGML_KCOL

}  // namespace
}  // namespace ggml

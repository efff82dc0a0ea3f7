// The K-quant tiles of the AVX2 and AVX-512 builds: the outputs interleaved into the lanes of
// a vector (8 with AVX2, 16 with AVX-512 VNNI), a tile of rows summed against them; `KTile` is
// this build's. Included by ggml_kquants.cpp only (its k_task drives them).
#pragma once

#include "ggml_kdecode.h"

namespace ggml {
namespace {

#if defined(CELLSERVE_GGML_KCOL)
// ---- the K-quant tiles (AVX2 and AVX-512 builds): 8 outputs in the 8 lanes of a vector ----
//
// A tile is 8 outputs x kMR rows. The 8 outputs' super-blocks are decoded (dec_k_regs) and
// interleaved into a KCol: per 4 values, one vector of the 8 outputs' 4 bytes, so that one
// vpmaddubsw by a row's 4 int8 values broadcast (vpbroadcastd) gives each output's 2 pair sums.
// Those are summed in int16 over L groups of 4 values (Q4_K: its 32-value sub-block, L = 8:
// 8 * 2 * 15 * 127 < 2^15; Q5_K 4: 4 * 2 * 31 * 127; Q6_K 2: 2 * 2 * 63 * 127), then one
// vpmaddwd by the outputs' scales: 1.1 (Q4_K) to 1.5 (Q6_K) multiply instructions per 32
// multiply-adds, where a row-major block takes 2 (vpmaddubsw, then vpmaddwd by the scale of each
// 32 values). The minimums' sums the same way, per pair of 16s, by the row's s16. Per
// super-block and row, in float (lane o: output o): f = fma(isum, d * d_x, f), then
// f = fnmadd(imin, dm * d_x, f); a tile's end stores 8 outputs of a row at once, no horizontal
// sums. k_gemv (one row) sums the same integers in its own order and applies the same float
// operations: a row alone gets the bits it gets in a batch.
constexpr int kMR = 4;
constexpr int64_t kKBCol = 4;  // super-blocks interleaved at a time: 4 x 2880 bytes of L1

struct KCol {
  alignas(32) uint8_t u[64][32];  // per 4 values g: output o's 4 bytes at 4o
  alignas(32) int16_t sc[16][16];  // per 16 values i: output o's scale in lanes 2o and 2o + 1
  alignas(32) int16_t mn[8][16];   // per pair of 16s i: output o's mn[2i], mn[2i + 1] in 2o, 2o + 1
  alignas(32) float d[8], dm[8];
};

// dword o of out[i] = dword i of in[o]
inline void transpose8(const __m256i* in, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // inputs 4h..4h + 3: u[4h + j] holds their dwords j, j + 4
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// outputs [0, no) of a super-block column, at most 8 (output o's block at blk + o * row_bytes; the
// others zeros), interleaved: group g's 8 outputs' 4 values at u + g * u_step, the scales of the
// 16s i at sc + i * step (as int16 pairs (sc, sc) for vpmaddwd, or with kSc32 as int32 for
// vpmulld), the minimums' pairs i at mn + i * step, d and dm. One KCol (AVX2), half a KCol16.
template <int64_t T, bool kSc32>
inline void pack8(const uint8_t* blk, int64_t row_bytes, int no, uint8_t* u, void* sc, int16_t* mn,
                  int64_t step, float* d, float* dm) {
  constexpr int64_t B = Fmt<T>::B;
  __m256i uo[8][8], sc_lo[8], sc_hi[8], mo[8];
  for (int o = 0; o < 8; ++o) {
    if (o < no) {
      const uint8_t* p = blk + o * row_bytes;
      for (int64_t l = 0; l < B; l += 64) __builtin_prefetch(p + kKBCol * B + l);
      KRegs r;
      dec_k_regs<T>(p, r);
      for (int c = 0; c < 8; ++c) uo[o][c] = r.u[c];
      if constexpr (kSc32) {  // the 16 scales as dwords in order
        sc_lo[o] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(r.sc));
        sc_hi[o] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(r.sc, 1));
      } else {  // as dwords (sc, sc) in order: unpack works within 128-bit halves
        const __m256i lo = _mm256_unpacklo_epi16(r.sc, r.sc), hi = _mm256_unpackhi_epi16(r.sc, r.sc);
        sc_lo[o] = _mm256_permute2x128_si256(lo, hi, 0x20);
        sc_hi[o] = _mm256_permute2x128_si256(lo, hi, 0x31);
      }
      mo[o] = r.mn;
      d[o] = r.d;
      dm[o] = r.dm;
    } else {
      for (int c = 0; c < 8; ++c) uo[o][c] = _mm256_setzero_si256();
      sc_lo[o] = sc_hi[o] = mo[o] = _mm256_setzero_si256();
      d[o] = dm[o] = 0.f;
    }
  }
  auto store = [step](void* base, int i, __m256i v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(static_cast<uint8_t*>(base) + i * step), v);
  };
  __m256i in[8], out[8];
  for (int c = 0; c < 8; ++c) {
    for (int o = 0; o < 8; ++o) in[o] = uo[o][c];
    transpose8(in, out);
    for (int g = 0; g < 8; ++g) store(u, 8 * c + g, out[g]);
  }
  transpose8(sc_lo, out);
  for (int i = 0; i < 8; ++i) store(sc, i, out[i]);
  transpose8(sc_hi, out);
  for (int i = 0; i < 8; ++i) store(sc, 8 + i, out[i]);
  transpose8(mo, out);
  for (int i = 0; i < 8; ++i) store(mn, i, out[i]);
}

template <int64_t T>
inline void pack_kcol(const uint8_t* blk, int64_t row_bytes, int no, KCol& col) {
  pack8<T, false>(blk, row_bytes, no, col.u[0], col.sc[0], col.mn[0], 32, col.d, col.dm);
}

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// rows [0, MR) (x: row 0's int8 values at the chunk's first super-block, rows k apart; xd, xs:
// its d and s16 there, rows nb and k / 16 apart) times a KCol column over nkb super-blocks;
// facc[r] accumulates row r's 8 outputs
template <int64_t T, int MR>
__attribute__((noinline)) void k_micro(const KCol* buf, int64_t nkb, const int8_t* x, int64_t k,
                                       const float* xd, int64_t nb, const int16_t* xs, __m256* facc,
                                       bool first) {
  constexpr int L = T == Q4_K ? 8 : T == Q5_K ? 4 : 2;
  // the float accumulators stay in memory (facc: one load and store a super-block), the 16
  // vector registers for the integer sums: a (the current L groups), acc (the super-block)
  if (first)
    for (int r = 0; r < MR; ++r) facc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nkb; ++b) {
    const KCol& w = buf[b];
    const int8_t* xb = x + 256 * b;
    __m256i acc[MR], a[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
    // one sum of L groups at a time, each a chain held in a register (the empty asm): gcc
    // otherwise rebalanced the sums into trees, all the products first, spilled to the stack
#pragma GCC unroll 1
    for (int g0 = 0; g0 < 64; g0 += L) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.u[g0]));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) a[r] = _mm256_maddubs_epi16(w0, bcast4(xb + r * k + 4 * g0));
#pragma GCC unroll 8
      for (int g = g0 + 1; g < g0 + L; ++g) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.u[g]));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          a[r] = _mm256_add_epi16(a[r], _mm256_maddubs_epi16(wv, bcast4(xb + r * k + 4 * g)));
          asm("" : "+x"(a[r]));
        }
      }
      const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.sc[g0 / 4]));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(a[r], s));
        asm("" : "+x"(acc[r]));
      }
    }
    // the minimums, a chain per row as well (a's registers)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i mv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.mn[i]));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i t = _mm256_madd_epi16(mv, bcast4(xs + r * (k / 16) + 16 * b + 2 * i));
        a[r] = i == 0 ? t : _mm256_add_epi32(a[r], t);
        asm("" : "+x"(a[r]));
      }
    }
    const __m256 d = _mm256_load_ps(w.d), dm = _mm256_load_ps(w.dm);
    for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(d, dx), facc[r]);
      facc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(a[r]), _mm256_mul_ps(dm, dx), f);
    }
  }
}

// row r's 8 outputs (the first no) -> y
inline void store_outputs(float* y, __m256 v, int no) {
  if (no == 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  std::copy(t, t + no, y);
}

// what k_task needs of a tile's width: the interleaved column, the accumulator, lanes (outputs
// a column), super-blocks interleaved at a time, rows a micro-kernel, and the three steps
struct Tile8 {
  using Col = KCol;
  using Acc = __m256;
  static constexpr int64_t kLanes = 8, kKB = kKBCol, kRows = kMR;
  static constexpr int64_t kGroupStride = 1;  // a column's next super-block: B bytes on
  template <int64_t T>
  static void pack(const uint8_t* blk, int64_t row_bytes, int no, Col& col) {
    pack_kcol<T>(blk, row_bytes, no, col);
  }
  template <int64_t T, int MR = kMR>  // mr rows (at most MR)
  static void micro(int mr, const Col* buf, int64_t nkb, const int8_t* x, int64_t k, const float* xd,
                    int64_t nb, const int16_t* xs, Acc* facc, bool first) {
    if constexpr (MR > 1)
      if (mr < MR) return micro<T, MR - 1>(mr, buf, nkb, x, k, xd, nb, xs, facc, first);
    k_micro<T, MR>(buf, nkb, x, k, xd, nb, xs, facc, first);
  }
  static void store(float* y, Acc v, int no) { store_outputs(y, v, no); }
};

#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
// ---- the AVX-512 VNNI build's K-quant tiles: 16 outputs in the lanes of a zmm ----
//
// The AVX2 tiles' design at 16 lanes, with vpdpbusd: per group of 4 values and row, one
// vpdpbusd of the 16 outputs' 4 bytes by the row's 4 int8 values (broadcast from memory) adds
// each output's 4 products in int32; the sums of a 16 (Q6_K) or a 32 (Q4_K, Q5_K: one scale)
// times the outputs' int32 scales (vpmulld); the minimums by vpdpwssd of the outputs' pairs of
// minimums and the row's pair of s16. The same exact integers as the AVX2 tiles and k_gemv, then
// the same two float operations per super-block, row and output: a row's y does not depend on
// the rows beside it. Against kMR16 rows of 32 values: 8 vpdpbusd + 1 vpmulld + 1 vpaddd per
// row, where the 512-bit form of the AVX2 tiles takes 8 vpmaddubsw + 7 vpaddw + 1 vpmaddwd + 1
// vpaddd, and k_micro over row-major blocks (the design before) 3 per 128 values and
// (output, row) plus a horizontal sum per output at a tile's end.
constexpr int kMR16 = 8;
constexpr int64_t kKBCol16 = 2;  // super-blocks interleaved at a time: 2 x 5760 bytes of L1

struct KCol16 {
  alignas(64) uint8_t u[64][64];   // per 4 values g: output o's 4 bytes at 4o
  alignas(64) int32_t sc[16][16];  // per 16 values i: output o's scale in lane o
  alignas(64) int16_t mn[8][32];   // per pair of 16s i: output o's mn[2i], mn[2i + 1] in 2o, 2o + 1
  alignas(64) float d[16], dm[16];
};

template <int64_t T>
inline void pack_kcol16(const uint8_t* blk, int64_t row_bytes, int no, KCol16& col) {
  for (int h = 0; h < 2; ++h)  // outputs 8h .. 8h + 7 into the half h of each 64 bytes
    pack8<T, true>(blk + 8 * h * row_bytes, row_bytes, std::clamp(no - 8 * h, 0, 8), col.u[0] + 32 * h,
                   col.sc[0] + 8 * h, col.mn[0] + 16 * h, 64, col.d + 8 * h, col.dm + 8 * h);
}

inline __m512i bcast4z(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// rows [0, MR) times a KCol16 column over nkb super-blocks (arguments as k_micro's); facc[r]
// accumulates row r's 16 outputs
template <int64_t T, int MR>
__attribute__((noinline)) void k_micro16(const KCol16* buf, int64_t nkb, const int8_t* x, int64_t k,
                                         const float* xd, int64_t nb, const int16_t* xs, __m512* facc,
                                         bool first) {
  constexpr int L = T == Q6_K ? 4 : 8;  // groups of 4 values under one scale
  __m512 f[MR];
  for (int r = 0; r < MR; ++r) f[r] = first ? _mm512_setzero_ps() : facc[r];
  for (int64_t b = 0; b < nkb; ++b) {
    const KCol16& w = buf[b];
    const int8_t* xb = x + 256 * b;
    __m512i acc[MR], t[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int g0 = 0; g0 < 64; g0 += L) {
      for (int r = 0; r < MR; ++r) t[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = g0; g < g0 + L; ++g) {
        const __m512i wv = _mm512_load_si512(w.u[g]);
        for (int r = 0; r < MR; ++r) t[r] = _mm512_dpbusd_epi32(t[r], wv, bcast4z(xb + r * k + 4 * g));
      }
      const __m512i s = _mm512_load_si512(w.sc[g0 / 4]);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_add_epi32(acc[r], _mm512_mullo_epi32(t[r], s));
    }
    // the minimums: t's registers
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i mv = _mm512_load_si512(w.mn[i]);
      for (int r = 0; r < MR; ++r)
        t[r] = _mm512_dpwssd_epi32(i == 0 ? _mm512_setzero_si512() : t[r], mv,
                                   bcast4z(xs + r * (k / 16) + 16 * b + 2 * i));
    }
    const __m512 d = _mm512_load_ps(w.d), dm = _mm512_load_ps(w.dm);
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, dx), f[r]);
      f[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(dm, dx), f[r]);
    }
  }
  for (int r = 0; r < MR; ++r) facc[r] = f[r];
}

struct Tile16 {
  using Col = KCol16;
  using Acc = __m512;
  static constexpr int64_t kLanes = 16, kKB = kKBCol16, kRows = kMR16;
  static constexpr int64_t kGroupStride = 1;
  template <int64_t T>
  static void pack(const uint8_t* blk, int64_t row_bytes, int no, Col& col) {
    pack_kcol16<T>(blk, row_bytes, no, col);
  }
  template <int64_t T, int MR = kMR16>
  static void micro(int mr, const Col* buf, int64_t nkb, const int8_t* x, int64_t k, const float* xd,
                    int64_t nb, const int16_t* xs, Acc* facc, bool first) {
    if constexpr (MR > 1)
      if (mr < MR) return micro<T, MR - 1>(mr, buf, nkb, x, k, xd, nb, xs, facc, first);
    k_micro16<T, MR>(buf, nkb, x, k, xd, nb, xs, facc, first);
  }
  static void store(float* y, Acc v, int no) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << no) - 1), v);
  }
};
using KTile = Tile16;
#else
using KTile = Tile8;
#endif
#endif  // CELLSERVE_GGML_KCOL

}  // namespace
}  // namespace ggml

// The K-quants' prompt chunks on AMX (Sapphire Rapids and later Xeons): the VNNI tiles' exact
// integers from three tile products per 64 values. Included by ggml_kquants.cpp only (after
// ggml_ktiles.h and ggml_krepack.h: KCol16, pack_kcol16, Tile16, the repacked layout).
//
// A column of 16 outputs is packed as the VNNI tiles pack it (pack_kcol16, or kcol16_from_x16
// from a repacked Q4_K group), then once more for the tiles (KAmx): each value's weight times its
// 16's scale, W = u * sc, in two digits W = 64 hi + lo, and each value's minimum, as B operands
// (per 4 values g, the 16 outputs' 4 bytes at 4o). Per 64 values and 16 rows, the rows' int8
// values as they lie (A: k bytes apart) times lo (tdpbsud), hi and the minimums (tdpbssd) give
//   sum_i sc[i] * dot16(u_i, x_i) = 64 * (x . hi) + (x . lo),   sum_i mn[i] * s16[i] = x . mn
// the VNNI tiles' two integers exactly (|x . hi| <= 256 * 126 * 127, 64 times that < 2^31), then
// k_micro16's two float operations per super-block, row and output, in the same order: the bits
// of the VNNI tiles, k_gemv and the repacked micro-kernels at every row count (a row's y does
// not depend on which kernel ran it). No per-16 scaling in the vector units: multiplying each
// 16's (or 32's) sums by its scale there, one tile product per 32 values, ran at 0.6-1.3x the
// VNNI tiles (2-core Xeon with AMX, 16-512 rows).
//
// AMX runs where the CPU has AMX-INT8 and Linux grants the tiles' data (arch_prctl
// ARCH_REQ_XCOMP_PERM, once a process), from 32 rows (kAmxRows); CELLSERVE_AMX=0 or
// ggml_amx(0) switch it off (A/B runs, tests). Each task loads its tile configuration and
// releases the tiles at its end, so a library that uses AMX on the same thread (oneDNN) is not
// disturbed. Where Linux refuses the permission (a thread's sigaltstack too small for the tiles'
// signal frame) AMX stays off for the process and the VNNI tiles run.
#pragma once

#include "ggml_kdecode.h"

#if defined(CELLSERVE_GGML_KCOL) && defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__) && \
    defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) && __GNUC__ >= 11)
#define CELLSERVE_GGML_AMX 1

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace ggml {
namespace {

// rows from which a part runs on AMX: below, packing a column for the tiles costs more than the
// tiles save (1.5B-sized Q4_K / Q6_K linears, 16 rows: 0.6-0.9x the VNNI tiles; 64: 1.3-1.7x)
constexpr int64_t kAmxRows = 32;
// rows a tile of rows: their int8 values within ~1 MB of L2 (2 MB a core on Sapphire Rapids)
constexpr int64_t kAmxRowBytes = 1 << 20;
constexpr int64_t kAmxKB = 2;  // super-blocks packed at a time (2 x (5.8 + 12.2) KB)

// whether the CPU has AMX-INT8 and the kernel lets this process use the tiles' data
inline bool amx_granted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

inline bool amx_available() {
  static const bool ok = [] {
    const char* env = std::getenv("CELLSERVE_AMX");
    return !(env && std::strcmp(env, "0") == 0) && amx_granted();
  }();
  return ok;
}

inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool amx_on() { return amx_switch().load(std::memory_order_relaxed) && amx_available(); }

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes: tmm0-2 the sums (16 rows x 16 int32), tmm3 the rows' 64 values
// (A), tmm4-6 the B operands (16 groups of 4 values x the 16 outputs' 4 bytes)
__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure() {
  AmxConfig c;
  for (int t = 0; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  // NOTE: GCC 12 does not see that ldtilecfg reads c: without this the shapes were never stored
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile,amx-int8"))) inline void amx_release() { _tile_release(); }

// a repacked Q4_K group's super-block at s (ggml_krepack.h) -> the KCol16 that pack_kcol16
// gives from the file's blocks: per 4 values the 16 outputs' 4 bytes, per 16 values the scale of
// its 32, per pair of 16s the minimums' pair (m, m), d and dmin
inline void kcol16_from_x16(const uint8_t* s, KCol16& col) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), ff = _mm512_set1_epi32(0xff);
  const uint8_t* q = s + 256;
  for (int c = 0; c < 32; ++c) {
    const __m512i p = _mm512_loadu_si512(q + 64 * c);
    const int g = 16 * (c / 8) + c % 8;
    _mm512_store_si512(col.u[g], _mm512_and_si512(p, low4));
    _mm512_store_si512(col.u[g + 8], _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));
  }
  __m512i w[4];
  scale_words16(s, w);
  for (int sb = 0; sb < 8; ++sb) {
    const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(w[sb / 4], 8 * (sb % 4)), ff);
    _mm512_store_si512(col.sc[2 * sb], sc);
    _mm512_store_si512(col.sc[2 * sb + 1], sc);
    const __m512i m = _mm512_and_si512(_mm512_srli_epi32(w[2 + sb / 4], 8 * (sb % 4)), ff);
    _mm512_store_si512(col.mn[sb], _mm512_or_si512(m, _mm512_slli_epi32(m, 16)));
  }
  _mm512_store_ps(col.d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))));
  _mm512_store_ps(col.dm, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32))));
}

// A super-block of 16 outputs as the tiles' B operands: per 4 values g, the outputs' 4 bytes at
// 4o, of lo and hi (W = u * sc = 64 hi + lo: lo 0..63, hi -126..125, |W| <= 63 * 128) and of
// each value's minimum (its 16's mn: Q4_K / Q5_K 0..63, Q6_K its int8 scale)
struct KAmx {
  alignas(64) uint8_t lo[64][64];
  alignas(64) int8_t hi[64][64];
  alignas(64) int8_t mn[64][64];
  alignas(64) float d[16], dm[16];
};

inline void kamx_from_kcol16(const KCol16& col, KAmx& a) {
  const __m512i m16 = _mm512_set1_epi32(0xffff), low6 = _mm512_set1_epi16(63);
  const __m512i lowb = _mm512_set1_epi16(0xff);
  // byte 0 of each dword into its 4 bytes
  const __m512i rep = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000);
  for (int i = 0; i < 16; ++i) {  // the 16 values i: groups 4i .. 4i + 3
    const __m512i sc32 = _mm512_load_si512(col.sc[i]);  // lane o: output o's scale (int32)
    const __m512i sc16 = _mm512_or_si512(_mm512_and_si512(sc32, m16), _mm512_slli_epi32(sc32, 16));
    const __m512i pair = _mm512_load_si512(col.mn[i / 2]);  // lane o: (mn[2j], mn[2j + 1])
    const __m512i mn = _mm512_shuffle_epi8(i % 2 ? _mm512_srli_epi32(pair, 16) : pair, rep);
    for (int g = 4 * i; g < 4 * i + 4; ++g) {
      const __m512i u = _mm512_load_si512(col.u[g]);
      const __m512i we = _mm512_mullo_epi16(_mm512_and_si512(u, lowb), sc16);  // even bytes' W
      const __m512i wo = _mm512_mullo_epi16(_mm512_srli_epi16(u, 8), sc16);    // odd bytes' W
      const __m512i lo =
          _mm512_or_si512(_mm512_and_si512(we, low6), _mm512_slli_epi16(_mm512_and_si512(wo, low6), 8));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(we, 6), lowb),
                                         _mm512_slli_epi16(_mm512_srai_epi16(wo, 6), 8));
      _mm512_store_si512(a.lo[g], lo);
      _mm512_store_si512(a.hi[g], hi);
      _mm512_store_si512(a.mn[g], mn);
    }
  }
  _mm512_store_ps(a.d, _mm512_load_ps(col.d));
  _mm512_store_ps(a.dm, _mm512_load_ps(col.dm));
}

// 16 rows (x: row 0's values at the chunk's first super-block, rows k apart; xd: its d there,
// rows nb apart) times nkb KAmx super-blocks; facc[r] accumulates row r's 16 outputs (from zero
// where first)
__attribute__((target("amx-tile,amx-int8"), noinline)) void amx_micro16(const KAmx* buf, int64_t nkb,
                                                                       const int8_t* x, int64_t k,
                                                                       const float* xd, int64_t nb,
                                                                       __m512* facc, bool first) {
  alignas(64) int32_t cs[3][16][16];
  // NOTE: GCC 12's tile loads tell the compiler of no memory they read: the caller's stores of
  // buf must not move past them (this function is noinline for that too)
  asm volatile("" : : : "memory");
  for (int64_t b = 0; b < nkb; ++b) {
    const KAmx& w = buf[b];
    const int8_t* xb = x + 256 * b;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int c = 0; c < 4; ++c) {
      _tile_loadd(3, xb + 64 * c, k);
      _tile_loadd(4, w.lo[16 * c], 64);
      _tile_dpbsud(0, 3, 4);
      _tile_loadd(5, w.hi[16 * c], 64);
      _tile_dpbssd(1, 3, 5);
      _tile_loadd(6, w.mn[16 * c], 64);
      _tile_dpbssd(2, 3, 6);
    }
    _tile_stored(0, cs[0], 64);
    _tile_stored(1, cs[1], 64);
    _tile_stored(2, cs[2], 64);
    const __m512 d = _mm512_load_ps(w.d), dm = _mm512_load_ps(w.dm);
    for (int r = 0; r < 16; ++r) {
      const __m512i ia =
          _mm512_add_epi32(_mm512_load_si512(cs[0][r]), _mm512_slli_epi32(_mm512_load_si512(cs[1][r]), 6));
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
      __m512 f = first && b == 0 ? _mm512_setzero_ps() : facc[r];
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(d, dx), f);
      facc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cs[2][r])), _mm512_mul_ps(dm, dx), f);
    }
  }
}

// a task's outputs [o0, o1) of a K part (kRepacked: repacked Q4_K groups) over every row: per tile
// of rows, per column of 16 outputs, per kAmxKB super-blocks: those packed once (KCol16, then
// KAmx), then the tile's rows 16 at a time on AMX (the rest on the VNNI tile)
template <int64_t T, bool kRepacked>
void amx_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, const uint8_t* w,
              int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  const int64_t row_tile = std::clamp<int64_t>(kAmxRowBytes / k / 16 * 16, 16, 512);
  thread_local std::vector<KCol16> bufv(kAmxKB);
  thread_local std::vector<KAmx> amxv(kAmxKB);
  thread_local std::vector<__m512> faccv;
  faccv.resize(row_tile);
  KCol16* buf = bufv.data();
  KAmx* abuf = amxv.data();
  __m512* facc = faccv.data();
  amx_configure();
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0, n16 = nr / 16 * 16;
    for (int64_t og = o0; og < o1; og += 16) {
      const int no = static_cast<int>(std::min<int64_t>(16, o1 - og));
      // the column's lines loaded back to back before it is packed (ggml_kdecode.h)
      if (r0 == 0 && no * row_bytes <= kColumnLoad) load_lines(w + og * row_bytes, no * row_bytes);
      for (int64_t b0 = 0; b0 < nb; b0 += kAmxKB) {
        const int64_t nkb = std::min(kAmxKB, nb - b0);
        for (int64_t b = 0; b < nkb; ++b) {
          if constexpr (kRepacked)
            kcol16_from_x16(w + og * row_bytes + (b0 + b) * kX16Bytes, buf[b]);
          else
            pack_kcol16<T>(w + og * row_bytes + (b0 + b) * B, row_bytes, no, buf[b]);
          if (n16 > 0) kamx_from_kcol16(buf[b], abuf[b]);
        }
        const int64_t xo = b0 * 256, so = b0 * 16;
        for (int64_t rr = 0; rr < n16; rr += 16) {
          const int64_t row = r0 + rr;
          amx_micro16(abuf, nkb, X.q + row * k + xo, k, X.d + row * nb + b0, nb, facc + rr, b0 == 0);
        }
        for (int64_t rr = n16; rr < nr; rr += kMR16) {
          const int64_t row = r0 + rr;
          Tile16::micro<T>(static_cast<int>(std::min<int64_t>(kMR16, nr - rr)), buf, nkb, X.q + row * k + xo,
                           k, X.d + row * nb + b0, nb, X.s16 + row * (k / 16) + so, facc + rr, b0 == 0);
        }
      }
      for (int64_t r = 0; r < nr; ++r) Tile16::store(y + (r0 + r) * n + col0 + og, facc[r], no);
    }
  }
  amx_release();
}

}  // namespace
}  // namespace ggml
#endif

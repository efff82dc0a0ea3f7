// The K-quants (Q4_K, Q5_K, Q6_K) of ggml_linear: activations per 256, integer super-blocks,
// register tiles.
//
// As llama.cpp's q8_K: each activation row quantized per 256 values (one super-block) with one
// float d = max|x| / 127 and, per 16 values, the sum s16 of their int8 values (mx = d * s16). A
// weight super-block is unsigned values u (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, in order), an
// integer scale per 16 values sc (Q4_K/Q5_K: the 6-bit scale of its 32, Q6_K: its int8 scale)
// and an integer minimum per 16 mn with a float factor dm (Q4_K/Q5_K: the 6-bit minimum and
// dmin; Q6_K: mn = sc and dm = 32 d, its offset of 32), so that per super-block
//   y[r, o] += d_x * d * sum_j sc[j] * dot16(u_j, xq_j)  -  d_x * dm * sum_j mn[j] * s16[j]
// with both sums exact in int32, then two float operations per super-block and (output, row).
// Every x86 build with AVX2 interleaves the outputs into the lanes of a vector ("the K-quant
// tiles" below: 8 outputs a vector, 16 with AVX-512 VNNI); one row goes to k_gemv, which sums
// the same integers in its own order and applies the same float operations in the same order.
// The portable build: k_micro below, one output and one row at a time over blocks decoded into
// KBlk, with float minimums mw (-dm * mn) against mx. Block layouts: ggml_blocks.cpp's head.
// The parts: ggml_kdecode.h (super-blocks decoded, rows quantized), ggml_ktiles.h (the tiles),
// ggml_kgemv.h (a few rows); this file drives them over a task's outputs.

#include "ggml_formats.h"
#include "ggml_kdecode.h"
#include "ggml_kgemv.h"
#include "ggml_ktiles.h"
#include "ggml_krepack.h"
#include "ggml_kamx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace ggml {
namespace {

// Rows a tile: at most kKTile, their int8 values within kKTileBytes. Every column of outputs
// passes over the whole tile, a few super-blocks (1-2 KB a row) at a time, so the tile is read
// from L2 (256 KB: half of Zen 3's, a quarter of Zen 4/5's), each decoded block feeding the
// tile's rows. An L1 budget (32 KB) left 2 rows a tile at k = 8960 (Qwen2.5-1.5B's ffn_down):
// each block decoded for every 2 rows, 100 against 220-270 GMAC/s for the L2 budget (2 Zen 5
// cores, 300 rows).
constexpr int64_t kKTile = 64;
constexpr int64_t kKTileBytes = 262144;

#if defined(CELLSERVE_GGML_KCOL)
// a task's outputs [o0, o1) of a K part over every row: per tile of rows, per column of
// Tile::kLanes outputs, per Tile::kKB super-blocks: those interleaved once into buf, then the
// tile's rows Tile::kRows at a time
template <int64_t T, class Tile>
void k_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t row_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  thread_local std::vector<typename Tile::Col> bufv(Tile::kKB);
  typename Tile::Col* buf = bufv.data();
  alignas(64) typename Tile::Acc facc[kKTile];
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0;
    for (int64_t og = o0; og < o1; og += Tile::kLanes) {
      const int no = static_cast<int>(std::min(Tile::kLanes, o1 - og));
      // from memory once: later row tiles find the column in L1 / L2
      if (r0 == 0 && no * row_bytes <= kColumnLoad) load_lines(w + og * row_bytes, no * row_bytes);
      for (int64_t b0 = 0; b0 < nb; b0 += Tile::kKB) {
        const int64_t nkb = std::min(Tile::kKB, nb - b0);
        for (int64_t b = 0; b < nkb; ++b)
          Tile::template pack<T>(w + og * row_bytes + (b0 + b) * B * Tile::kGroupStride, row_bytes,
                                 no, buf[b]);
        for (int64_t rr = 0; rr < nr; rr += Tile::kRows) {
          const int64_t row = r0 + rr;
          Tile::template micro<T>(static_cast<int>(std::min(Tile::kRows, nr - rr)), buf, nkb,
                                  X.q + row * k + b0 * 256, k, X.d + row * nb + b0, nb,
                                  X.s16 + row * (k / 16) + b0 * 16, facc + rr, b0 == 0);
        }
      }
      for (int64_t r = 0; r < nr; ++r) Tile::store(y + (r0 + r) * n + col0 + og, facc[r], no);
    }
  }
}
#else
constexpr int64_t kKB = 8;  // super-blocks decoded at a time

// the portable build: one output and one row at a time (x: the row at super-block 0 of the
// chunk, xd, xm: its d and mx there), over nkb decoded super-blocks; f accumulates
void k_micro(const KBlk* buf, int64_t nkb, const int8_t* x, const float* xd, const float* xm, float& f) {
  for (int64_t b = 0; b < nkb; ++b) {
    const KBlk& w = buf[b];
    const int8_t* xr = x + 256 * b;
    int32_t tot = 0;
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int l = 16 * g; l < 16 * g + 16; ++l) s += static_cast<int32_t>(w.u[l]) * xr[l];
      tot += w.sc[g] * s;
    }
    float mm = 0.f;
    for (int g = 0; g < 16; ++g) mm += w.mw[g] * xm[16 * b + g];
    f += static_cast<float>(tot) * (w.d * xd[b]) + mm;
  }
}

// a task's outputs [o0, o1) of a K part over every row: per tile of rows, per output, per kKB
// super-blocks: those decoded once into buf, then every row of the tile
template <int64_t T>
void k_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t row_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  thread_local std::vector<KBlk> bufv(kKB);
  KBlk* buf = bufv.data();
  float facc[kKTile];
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0;
    for (int64_t o = o0; o < o1; ++o) {
      for (int64_t r = 0; r < nr; ++r) facc[r] = 0.f;
      for (int64_t b0 = 0; b0 < nb; b0 += kKB) {
        const int64_t nkb = std::min(kKB, nb - b0);
        for (int64_t b = 0; b < nkb; ++b) dec_k<T>(w + o * row_bytes + (b0 + b) * B, buf[b]);
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t row = r0 + r;
          k_micro(buf, nkb, X.q + row * k + b0 * 256, X.d + row * nb + b0, X.mx + row * (k / 16) + b0 * 16,
                  facc[r]);
        }
      }
      for (int64_t r = 0; r < nr; ++r) y[(r0 + r) * n + col0 + o] = facc[r];
    }
  }
}
#endif

// a K tile's rows: a multiple of the micro-kernel's
#if defined(CELLSERVE_GGML_KCOL)
constexpr int64_t kTileMR = KTile::kRows;
#else
constexpr int64_t kTileMR = 1;
#endif

// rows up to which k_gemv takes a batch (4 at a time) instead of the tiles
constexpr int64_t kGemvRows = 5;

// A task's outputs of a K-quant part: one row goes to k_gemv where this build has one (same bits
// as the tiles, read faster), everything else to the tiles (16 outputs a tile with VNNI).
template <int64_t T>
void k_part_t(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
#if defined(CELLSERVE_GGML_KCOL)
  if (m <= kGemvRows) {  // up to 4 rows at a time
    for (int64_t r = 0; r < m; r += 4) {
      const Q8K Xr{X.q + r * k, X.d + r * (k / 256), X.mx, X.s16 + r * (k / 16), X.s32 + r * (k / 32)};
      float* yr = y + r * n;
      switch (std::min<int64_t>(4, m - r)) {
        case 1: k_gemv<T, 1>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
        case 2: k_gemv<T, 2>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
        case 3: k_gemv<T, 3>(Xr, k, n, yr, w, row_bytes, o0, o1, col0); break;
        default: k_gemv<T, 4>(Xr, k, n, yr, w, row_bytes, o0, o1, col0);
      }
    }
    return;
  }
#if defined(CELLSERVE_GGML_AMX)
  if (m >= kAmxRows && amx_on()) return amx_task<T, false>(X, m, k, n, y, w, row_bytes, o0, o1, col0);
#endif
  k_task<T, KTile>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#else
  k_task<T>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#endif
}

#if defined(CELLSERVE_GGML_REPACK)
// A task's outputs of a repacked Q4_K part: the repacked micro-kernel, except for more than 8
// rows on the 8-lane builds, where the AVX2 tiles run on columns unpacked from the repacked
// groups (Tile8R: no decode, no transpose), decoded once per tile of rows instead of once per 4
// rows (1.5B linears in decode order, forced AVX2, 16 / 32 rows: the repacked micro-kernel 220 /
// 366 ms, the file's tiles 183 / 310, these 174 / 307)
void repacked_part(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
                   const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
#if defined(CELLSERVE_GGML_AMX)
  if (m >= kAmxRows && amx_on()) return amx_task<Q4_K, true>(X, m, k, n, y, w, row_bytes, o0, o1, col0);
#endif
#if !(defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__))
  if (m > 2 * kRepackRows) return k_task<Q4_K, Tile8R>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#endif
  repacked_task(X, m, k, n, y, w, row_bytes, o0, o1, col0);
}
#endif

}  // namespace

Q8K quantize_rows_k(const float* x, int64_t m, int64_t k) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> f;
  thread_local std::vector<int16_t> s;
  const int64_t nb = k / 256;
  q.resize(m * k);
  f.resize(m * nb * 17);
  s.resize(m * nb * 24);
  // pointers, not the thread_local vectors, into the workers (each thread has its own)
  int8_t* qp = q.data();
  float* d = f.data();
  float* mx = f.data() + m * nb;
  int16_t* sp = s.data();
  int16_t* s32 = s.data() + m * nb * 16;
  at::parallel_for(0, m * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block_k(x + b * 256, qp + b * 256, d + b, mx + 16 * b, sp + 16 * b, s32 + 8 * b);
  });
  return {qp, d, mx, sp, s32};
}

int64_t k_tile_rows(int64_t k) {
  return std::max<int64_t>(kTileMR, std::min<int64_t>(kKTile, kKTileBytes / k) / kTileMR * kTileMR);
}

void k_part(int64_t type, const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  TORCH_CHECK_VALUE((type != Q4_K_X16 && type != Q4_K_X8) || type == repack_type(),
                    "ggml k_part: a Q4_K weight repacked for another build (type ", type, ")");
  switch (type) {
    case Q4_K: return k_part_t<Q4_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
    case Q5_K: return k_part_t<Q5_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
    case Q6_K: return k_part_t<Q6_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#if defined(CELLSERVE_GGML_REPACK)
    case kRepackType: return repacked_part(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#endif
    default: TORCH_CHECK_VALUE(false, "ggml k_part: GGML type ", type, " is not a K-quant");
  }
}

bool amx_mode(int64_t mode) {
#if defined(CELLSERVE_GGML_AMX)
  if (mode >= 0) amx_switch().store(mode != 0);
  return amx_on();
#else
  (void)mode;
  return false;
#endif
}

int64_t repack_type() {
#if defined(CELLSERVE_GGML_REPACK)
  return kRepackType;
#else
  return 0;
#endif
}

int64_t repack_lanes() {
#if defined(CELLSERVE_GGML_REPACK)
  return kRepackLanes;
#else
  return 0;
#endif
}

// ggml_krepack.h's layout: per group of G rows and super-block, the d's, the dmin's, the scales'
// dwords and the qs' dwords of the G outputs side by side
void repack_q4k(const uint8_t* src, uint8_t* dst, int64_t n, int64_t row_bytes) {
  const int64_t G = repack_lanes();
  TORCH_CHECK_VALUE(G > 0 && n % G == 0 && row_bytes % 144 == 0, "repack_q4k: ", n, " rows of ",
                    row_bytes, " bytes (", G, " rows a group, 144 bytes a super-block)");
  const int64_t nb = row_bytes / 144;
  at::parallel_for(0, n / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + g * G * row_bytes + b * 144 * G;
        for (int64_t o = 0; o < G; ++o) {
          const uint8_t* blk = src + (G * g + o) * row_bytes + b * 144;
          std::memcpy(out + 2 * o, blk, 2);
          std::memcpy(out + 2 * G + 2 * o, blk + 2, 2);
          for (int j = 0; j < 3; ++j) std::memcpy(out + 4 * G * (1 + j) + 4 * o, blk + 4 + 4 * j, 4);
          for (int c = 0; c < 32; ++c) std::memcpy(out + 4 * G * (4 + c) + 4 * o, blk + 16 + 4 * c, 4);
        }
      }
    }
  });
}

}  // namespace ggml

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
#include "ggml_formats.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace ggml {
namespace {

// a K super-block's 12 packed scale bytes -> 8 scales, then 8 minimums (6 bits each), as 4 words
inline void k_scale_words(const uint8_t* s, uint32_t* w) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  w[0] = a & 0x3f3f3f3fu;
  w[1] = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  w[2] = b & 0x3f3f3f3fu;
  w[3] = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
}

inline void k_scale_bytes(const uint8_t* s, uint8_t* bytes) {
  uint32_t w[4];
  k_scale_words(s, w);
  std::memcpy(bytes, w, 16);
}

#if defined(__AVX2__)
// the same bytes in a register (4-byte stores reloaded as 16 are not forwarded: a stall a block)
inline __m128i k_scale_vec(const uint8_t* s) {
  uint32_t w[4];
  k_scale_words(s, w);
  return _mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                        static_cast<int>(w[3]));
}
#endif

#if defined(__AVX2__)
// The AVX2 and AVX-512 builds' K-quants: every super-block's sums exact in integers (see "the
// K-quant tiles" below). A super-block decoded in registers: its values u as 8 chunks of 32 in
// order; per 16 values an integer scale sc and an integer minimum mn (Q4_K / Q5_K: the 6-bit
// scale and minimum of its 32; Q6_K: its int8 scale, and mn = sc for its offset of 32); the float factors
// d and dm (Q4_K / Q5_K: dmin; Q6_K: 32 d). Its dot product with a Q8K row (d_x, and s16: the
// sums of its int8 values per 16) is
//   d_x * d * sum_i sc[i] * dot16(u_i, x_i)  -  d_x * dm * sum_i mn[i] * s16[i]
// with both sums exact in int32.
#define CELLSERVE_GGML_KCOL 1
struct KRegs {
  __m256i u[8];
  __m256i sc;  // 16 int16
  __m256i mn;  // 16 int16
  float d, dm;
};

template <int64_t T>
void dec_k_regs(const uint8_t* blk, KRegs& o);

// Q4_K / Q5_K: sc, mn, d and dm from the header
inline void k_header_regs(const uint8_t* blk, KRegs& o) {
  const __m128i b = k_scale_vec(blk + 4);
  o.sc = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
  o.mn = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(b, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
  o.d = fp16(blk);
  o.dm = fp16(blk + 2);
}

template <>
inline void dec_k_regs<Q4_K>(const uint8_t* blk, KRegs& o) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
    o.u[2 * c] = _mm256_and_si256(v, low4);
    o.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  k_header_regs(blk, o);
}

template <>
inline void dec_k_regs<Q5_K>(const uint8_t* blk, KRegs& o) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  auto bit5 = [&](int s) {  // bit s of each qh byte -> 0x10 (16-bit shifts: bit 0 of a byte is its own)
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), one), 4);
  };
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 32 * c));
    o.u[2 * c] = _mm256_or_si256(_mm256_and_si256(v, low4), bit5(2 * c));
    o.u[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), bit5(2 * c + 1));
  }
  k_header_regs(blk, o);
}

template <>
inline void dec_k_regs<Q6_K>(const uint8_t* blk, KRegs& o) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    auto hi = [&](int shift) {
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, shift), three), 4);
    };
    o.u[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low4), hi(0));
    o.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), hi(2));
    o.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), hi(4));
    o.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), hi(6));
  }
  o.sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  o.mn = o.sc;
  o.d = fp16(blk + 208);
  o.dm = 32.f * o.d;
}
#else
// the portable build's super-block, decoded
struct KBlk {
  alignas(64) uint8_t u[256];
  alignas(64) float mw[16];
  alignas(64) int16_t sc[16];
  float d;
};

// Q4_K / Q5_K: sc, mw and d from the block's header
inline void k_mins(const uint8_t* blk, KBlk& o) {
  uint8_t bytes[16];
  k_scale_bytes(blk + 4, bytes);
  const float dmin = fp16(blk + 2);
  for (int j = 0; j < 16; ++j) {
    o.sc[j] = bytes[j / 2];
    o.mw[j] = -(dmin * static_cast<float>(bytes[8 + j / 2]));
  }
  o.d = fp16(blk);
}

template <int64_t T>
void dec_k(const uint8_t* blk, KBlk& o);

template <>
void dec_k<Q5_K>(const uint8_t* blk, KBlk& o) {
  float sc[16], mn[8];
  Fmt<Q5_K>::decode(blk, reinterpret_cast<int8_t*>(o.u), sc, mn);
  k_mins(blk, o);
}

template <>
void dec_k<Q4_K>(const uint8_t* blk, KBlk& o) {
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      o.u[64 * c + l] = qs[32 * c + l] & 0x0F;
      o.u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  }
  k_mins(blk, o);
}

template <>
void dec_k<Q6_K>(const uint8_t* blk, KBlk& o) {
  float sc[16];
  Fmt<Q6_K>::decode(blk, reinterpret_cast<int8_t*>(o.u), sc, nullptr);
  for (int i = 0; i < 256; ++i) o.u[i] = static_cast<uint8_t>(static_cast<int8_t>(o.u[i]) + 32);
  const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = fp16(blk + 208);
  for (int j = 0; j < 16; ++j) {
    o.sc[j] = scales[j];
    o.mw[j] = -32.f * d * static_cast<float>(scales[j]);
  }
  o.d = d;
}
#endif

// the activation rows per 256: q, d, mx (Q8K)
#if defined(__AVX2__)
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

void quantize_block_k(const float* x, int8_t* q, float* d, float* mx, int16_t* s16) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 32; ++i) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 8 * i), abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const float dd = amax / 127.f;
  *d = dd;
  for (int g = 0; g < 8; ++g) {  // 32 values: 4 vectors
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * i), inv));
    const int32_t s0 = hsum_i32(_mm256_add_epi32(i32[0], i32[1]));
    const int32_t s1 = hsum_i32(_mm256_add_epi32(i32[2], i32[3]));
    s16[2 * g] = static_cast<int16_t>(s0);
    s16[2 * g + 1] = static_cast<int16_t>(s1);
    mx[2 * g] = dd * static_cast<float>(s0);
    mx[2 * g + 1] = dd * static_cast<float>(s1);
    const __m256i w16a = _mm256_packs_epi32(i32[0], i32[1]), w16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * g), b8);
  }
}
#else
void quantize_block_k(const float* x, int8_t* q, float* d, float* mx, int16_t* s16) {
  float amax = 0.f;
  for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const float dd = amax / 127.f;
  *d = dd;
  for (int g = 0; g < 16; ++g) {
    int32_t sum = 0;
    for (int j = 16 * g; j < 16 * g + 16; ++j) {
      const auto v = static_cast<int8_t>(std::nearbyint(x[j] * inv));
      q[j] = v;
      sum += v;
    }
    s16[g] = static_cast<int16_t>(sum);
    mx[g] = dd * static_cast<float>(sum);
  }
}
#endif


// Rows a tile: at most kKTile, their int8 values within kKTileBytes. Every column of outputs
// passes over the whole tile, a few super-blocks (1-2 KB a row) at a time, so the tile is read
// from L2 (256 KB: half of Zen 3's, a quarter of Zen 4/5's), each decoded block feeding the
// tile's rows. An L1 budget (32 KB) left 2 rows a tile at k = 8960 (Qwen2.5-1.5B's ffn_down):
// each block decoded for every 2 rows, 100 against 220-270 GMAC/s for the L2 budget (2 Zen 5
// cores, 300 rows).
constexpr int64_t kKTile = 64;
constexpr int64_t kKTileBytes = 262144;
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
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // ql's 64 bytes with qh's 2-bit pairs 0 and 1, then 2 and 3
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(hb, three), 4));
      u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), three), 4));
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
template <int64_t T, int R>
void k_gemv(const Q8K& X, int64_t k, int64_t n, float* y, const uint8_t* w, int64_t row_bytes,
            int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
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
      for (int64_t b0 = 0; b0 < nb; b0 += Tile::kKB) {
        const int64_t nkb = std::min(Tile::kKB, nb - b0);
        for (int64_t b = 0; b < nkb; ++b)
          Tile::template pack<T>(w + og * row_bytes + (b0 + b) * B, row_bytes, no, buf[b]);
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
      const Q8K Xr{X.q + r * k, X.d + r * (k / 256), X.mx, X.s16 + r * (k / 16)};
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
  k_task<T, KTile>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#else
  k_task<T>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#endif
}

}  // namespace

Q8K quantize_rows_k(const float* x, int64_t m, int64_t k) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> f;
  thread_local std::vector<int16_t> s;
  const int64_t nb = k / 256;
  q.resize(m * k);
  f.resize(m * nb * 17);
  s.resize(m * nb * 16);
  // pointers, not the thread_local vectors, into the workers (each thread has its own)
  int8_t* qp = q.data();
  float* d = f.data();
  float* mx = f.data() + m * nb;
  int16_t* sp = s.data();
  at::parallel_for(0, m * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block_k(x + b * 256, qp + b * 256, d + b, mx + 16 * b, sp + 16 * b);
  });
  return {qp, d, mx, sp};
}

int64_t k_tile_rows(int64_t k) {
  return std::max<int64_t>(kTileMR, std::min<int64_t>(kKTile, kKTileBytes / k) / kTileMR * kTileMR);
}

void k_part(int64_t type, const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  switch (type) {
    case Q4_K: return k_part_t<Q4_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
    case Q5_K: return k_part_t<Q5_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
    case Q6_K: return k_part_t<Q6_K>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
    default: TORCH_CHECK_VALUE(false, "ggml k_part: GGML type ", type, " is not a K-quant");
  }
}

}  // namespace ggml

// The K-quants' super-blocks decoded (ggml_kquants.cpp says what is summed): the packed 6-bit
// scales and minimums, a super-block in registers (KRegs, AVX2 and AVX-512 builds) or in KBlk (the
// portable build), and an activation row quantized per 256 values (Q8K: q, d, mx, s16).
// Included by ggml_kquants.cpp only: its kernels are in one translation unit.
#pragma once

#include "ggml_formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ggml {
namespace {

// A column of outputs whose weights fit in kColumnLoad bytes (at k = 1536, 16 rows of Q4_K are
// 13.5 KB: q, k, v, o, gate, up and the output head of a 1.5B) is loaded whole before it is
// interleaved: one load per 64-byte line, back to back, so the misses overlap. Interleaving
// straight from memory left the loads to the decode's pace: from memory, 8 rows through an
// 8960x1536 Q4_K took 1.02 ms against 0.59 ms with the matrix in L3, and 0.83-0.86 ms with this
// load (32 rows: 2.09 -> 1.89-1.93 ms; 2-core Zen 4, 40 matrices in turn). Software prefetches
// of the next chunks (2 to 16 super-blocks ahead, into L1 or L2, in bursts or spread over the
// rows), a column-contiguous layout of the same bits and 2 MB pages all measured no better than
// no change. At k = 4096 (an 8B's 36 KB columns) 4-6% at 8 rows; the down projection's
// k = 8960 (80 KB a column) gained nothing, so longer columns are left to the interleave.
// The AMX tasks (ggml_kamx.h) load a column so before packing it: the 1.5B's linears in decode
// order at 32 rows ~4% faster a step (2-core Xeon, 10 pairs of runs, each won). The repacked
// groups' few-row kernel (ggml_krepack.h) does not: there it made 8 rows ~10% slower and 1 row
// no faster (the same Xeon).
constexpr int64_t kColumnLoad = 49152;

inline void load_lines(const uint8_t* p, int64_t bytes) {
  uint32_t acc = 0;
  for (int64_t l = 0; l < bytes; l += 64) acc += p[l];
  asm volatile("" : : "r"(acc));  // NOTE: the loads are the point; keep them
}

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
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    // bits s, s + 1 of each qh byte moved to bits 4, 5 and masked: a 16-bit shift carries bits
    // across the byte boundary only below bit 4 (left) or above bit 5 (right), where the mask
    // drops them; one or two instructions where a shift down, a mask and a shift up took three
    o.u[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    o.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    o.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, bits45));
    o.u[4 * h + 3] =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
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

// the activation rows per 256: q, d, mx, s16, s32 (Q8K)
#if defined(__AVX2__)
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

void quantize_block_k(const float* x, int8_t* q, float* d, float* mx, int16_t* s16, int16_t* s32) {
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
    s32[g] = static_cast<int16_t>(s0 + s1);  // |s| <= 32 * 127
    mx[2 * g] = dd * static_cast<float>(s0);
    mx[2 * g + 1] = dd * static_cast<float>(s1);
    const __m256i w16a = _mm256_packs_epi32(i32[0], i32[1]), w16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * g), b8);
  }
}
#else
void quantize_block_k(const float* x, int8_t* q, float* d, float* mx, int16_t* s16, int16_t* s32) {
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
  for (int g = 0; g < 8; ++g) s32[g] = static_cast<int16_t>(s16[2 * g] + s16[2 * g + 1]);
}
#endif

}  // namespace
}  // namespace ggml

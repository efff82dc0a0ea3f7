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
// - K-quants (Q4_K, Q5_K, Q6_K; every build): each activation row quantized per 256 values,
//   each super-block's sum exact in int32 with its integer scales, one float FMA per super-block
//   and (output, row); register tiles of outputs x rows (see "the K-quants" below; the AVX2
//   build: 8 outputs interleaved into the lanes of a vector, "the AVX2 build's K-quant tiles").
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
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kQ = 32;         // values per activation scale
constexpr int64_t kOutBlock = 16;  // outputs per task: their weights stay in L1/L2 over row tiles

enum GgmlType : int64_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
};

inline bool is_k(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

struct TypeInfo {
  int64_t elems, bytes;
  bool quantized;
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case F32: return {1, 4, false};
    case F16: return {1, 2, false};
    case BF16: return {1, 2, false};
    case Q4_0: return {32, 18, true};
    case Q4_1: return {32, 20, true};
    case Q5_0: return {32, 22, true};
    case Q5_1: return {32, 24, true};
    case Q8_0: return {32, 34, true};
    case Q4_K: return {256, 144, true};
    case Q5_K: return {256, 176, true};
    case Q6_K: return {256, 210, true};
    default:
      TORCH_CHECK_VALUE(false, "ggml: GGML type ", type,
                        " is not supported (F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, "
                        "Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14, BF16=30)");
  }
  return {0, 0, false};
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the same value as the portable conversion
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline float bf16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One decoded block: values q[E] (signed, or unsigned in [0, 31] where kHasMin), a scale per 16
// values, a minimum per 32 (kHasMin).
template <int64_t T>
struct Fmt;

template <>
struct Fmt<Q4_0> {
  static constexpr int64_t E = 32, B = 18;
  static constexpr bool kHasMin = false;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float*) {
    const float d = fp16(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>((qs[j] & 0x0F) - 8);
      q[16 + j] = static_cast<int8_t>((qs[j] >> 4) - 8);
    }
    sc[0] = sc[1] = d;
  }
};

template <>
struct Fmt<Q4_1> {
  static constexpr int64_t E = 32, B = 20;
  static constexpr bool kHasMin = true;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float* mn) {
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(qs[j] & 0x0F);
      q[16 + j] = static_cast<int8_t>(qs[j] >> 4);
    }
    sc[0] = sc[1] = fp16(b);
    mn[0] = fp16(b + 2);
  }
};

template <>
struct Fmt<Q5_0> {
  static constexpr int64_t E = 32, B = 22;
  static constexpr bool kHasMin = false;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float*) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
      q[16 + j] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (16 + j)) & 1) << 4)) - 16);
    }
    sc[0] = sc[1] = fp16(b);
  }
};

template <>
struct Fmt<Q5_1> {
  static constexpr int64_t E = 32, B = 24;
  static constexpr bool kHasMin = true;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float* mn) {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
      q[16 + j] = static_cast<int8_t>((qs[j] >> 4) | (((qh >> (16 + j)) & 1) << 4));
    }
    sc[0] = sc[1] = fp16(b);
    mn[0] = fp16(b + 2);
  }
};

template <>
struct Fmt<Q8_0> {
  static constexpr int64_t E = 32, B = 34;
  static constexpr bool kHasMin = false;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float*) {
    std::memcpy(q, b + 2, 32);
    sc[0] = sc[1] = fp16(b);
  }
};

// a K super-block's 8 sub-block scales d * sc[j] (twice each: per 16) and minimums -dmin * mn[j]
// from its 12 packed bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
// (minimums); 4-7 in the nibbles of bytes 8-11 with their top 2 bits in bytes 0-7's top bits.
// Four at a time in 32-bit words.
inline void k_scales(const uint8_t* s, float d, float dmin, float* sc, float* mn) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t words[4] = {a & 0x3f3f3f3fu, ((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)),
                             b & 0x3f3f3f3fu, (((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u))};
  uint8_t bytes[16];  // scales 0-7, then minimums 0-7
  std::memcpy(bytes, words, 16);
  for (int j = 0; j < 8; ++j) {
    sc[2 * j] = sc[2 * j + 1] = d * static_cast<float>(bytes[j]);
    mn[j] = -(dmin * static_cast<float>(bytes[8 + j]));
  }
}

template <>
struct Fmt<Q4_K> {
  static constexpr int64_t E = 256, B = 144;
  static constexpr bool kHasMin = true;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float* mn) {
    const float d = fp16(b), dmin = fp16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        q[64 * c + l] = static_cast<int8_t>(qs[32 * c + l] & 0x0F);
        q[64 * c + 32 + l] = static_cast<int8_t>(qs[32 * c + l] >> 4);
      }
    }
    k_scales(scales, d, dmin, sc, mn);
  }
};

template <>
struct Fmt<Q5_K> {
  static constexpr int64_t E = 256, B = 176;
  static constexpr bool kHasMin = true;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float* mn) {
    const float d = fp16(b), dmin = fp16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        q[64 * c + l] =
            static_cast<int8_t>((qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
        q[64 * c + 32 + l] =
            static_cast<int8_t>((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
      }
    }
    k_scales(scales, d, dmin, sc, mn);
  }
};

template <>
struct Fmt<Q6_K> {
  static constexpr int64_t E = 256, B = 210;
  static constexpr bool kHasMin = false;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float*) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16(b + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* l0 = ql + 64 * h;
      const uint8_t* h0 = qh + 32 * h;
      int8_t* o = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        o[l] = static_cast<int8_t>(((l0[l] & 0x0F) | ((h0[l] & 3) << 4)) - 32);
        o[32 + l] = static_cast<int8_t>(((l0[32 + l] & 0x0F) | (((h0[l] >> 2) & 3) << 4)) - 32);
        o[64 + l] = static_cast<int8_t>(((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32);
        o[96 + l] = static_cast<int8_t>(((l0[32 + l] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32);
      }
    }
    for (int i = 0; i < 16; ++i) sc[i] = d * static_cast<float>(scales[i]);
  }
};

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CELLSERVE_GGML_ZMM 1
#endif

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

// ---- the K-quants (Q4_K, Q5_K, Q6_K): activations per 256, integer super-blocks, register tiles
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
// The portable build: k_micro<1, 1> below over blocks decoded into KBlk, with float minimums mw
// (-dm * mn) against mx.

struct Q8K {
  const int8_t* q;     // [m, k]
  const float* d;      // [m, k / 256]
  const float* mx;     // [m, k / 16]: d * the sum of each 16 int8 values
  const int16_t* s16;  // [m, k / 16]: the sums themselves
};

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

// x [m, k] float32 -> this thread's Q8K buffers (valid until its next call)
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

// a task's outputs [o0, o1) of a K part over every row: per tile of rows, per 8 outputs, per
// kKBCol super-blocks: those interleaved once into buf, then the tile's rows kMR at a time
template <int64_t T>
void k_task(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t row_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  thread_local std::vector<KCol> bufv(kKBCol);
  KCol* buf = bufv.data();
  alignas(32) __m256 facc[kKTile];
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0;
    for (int64_t og = o0; og < o1; og += 8) {
      const int no = static_cast<int>(std::min<int64_t>(8, o1 - og));
      for (int64_t b0 = 0; b0 < nb; b0 += kKBCol) {
        const int64_t nkb = std::min(kKBCol, nb - b0);
        for (int64_t b = 0; b < nkb; ++b) pack_kcol<T>(w + og * row_bytes + (b0 + b) * B, row_bytes, no, buf[b]);
        for (int64_t rr = 0; rr < nr; rr += kMR) {
          const int64_t row = r0 + rr;
          const int8_t* x = X.q + row * k + b0 * 256;
          const float* xd = X.d + row * nb + b0;
          const int16_t* xs = X.s16 + row * (k / 16) + b0 * 16;
          __m256* f = facc + rr;
          switch (std::min<int64_t>(kMR, nr - rr)) {
            case 1: k_micro<T, 1>(buf, nkb, x, k, xd, nb, xs, f, b0 == 0); break;
            case 2: k_micro<T, 2>(buf, nkb, x, k, xd, nb, xs, f, b0 == 0); break;
            case 3: k_micro<T, 3>(buf, nkb, x, k, xd, nb, xs, f, b0 == 0); break;
            default: k_micro<T, kMR>(buf, nkb, x, k, xd, nb, xs, f, b0 == 0); break;
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) store_outputs(y + (r0 + r) * n + col0 + og, facc[r], no);
    }
  }
}

// a super-block's two integer sums with a Q8K row (x: its int8 values there, xs: its s16 there)
// as vectors whose lanes add up to them: ia to sum_i sc[i] * dot16(u_i, x_i), im to
// sum_i mn[i] * s16[i]
#if defined(CELLSERVE_GGML_ZMM) && defined(__AVX512VNNI__)
// VNNI: per 64 values one vpdpbusd (int32 lane L: values 4L .. 4L + 3), two 64s' lanes packed to
// int16 (exact: 4 * 63 * 127 < 2^15) and one vpdpwssd by the scales in that order (scv), the
// 512-bit sum folded to 256 bits: 11 vector instructions a block where the AVX2 form takes 32
template <int64_t T>
inline void k_block_sums(const uint8_t* blk, const int8_t* x, const int16_t* xs, __m256i& ia,
                         __m256i& im, float& d, float& dm) {
  KRegs r;
  dec_k_regs<T>(blk, r);
  // vpackssdw of the 64s 2h and 2h + 1 (per 128 bits c: 4 lanes of each): int16 lane 8c + e
  // holds the 16 8h + c (e < 4) or 8h + 4 + c (e >= 4), whose scale the pair of lanes takes
  const __m512i q = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17,
                                     16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i e4 = _mm512_and_si512(_mm512_srli_epi16(q, 2), _mm512_set1_epi16(1));  // e >= 4
  const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(q, 3), _mm512_slli_epi16(e4, 2));
  const __m512i sc = _mm512_castsi256_si512(r.sc);
  __m512i acc = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i u0 = _mm512_inserti64x4(_mm512_castsi256_si512(r.u[4 * h]), r.u[4 * h + 1], 1);
    const __m512i u1 = _mm512_inserti64x4(_mm512_castsi256_si512(r.u[4 * h + 2]), r.u[4 * h + 3], 1);
    const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(x + 128 * h));
    const __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, _mm512_loadu_si512(x + 128 * h + 64));
    const __m512i h8 = _mm512_set1_epi16(static_cast<int16_t>(8 * h));
    const __m512i scv = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, h8), sc);
    acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(t0, t1), scv);
  }
  ia = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  im = _mm256_madd_epi16(r.mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
  d = r.d;
  dm = r.dm;
}
#else
// (vpmaddubsw, vpmaddwd by the scale of each 16, in the block's own order)
template <int64_t T>
inline void k_block_sums(const uint8_t* blk, const int8_t* x, const int16_t* xs, __m256i& ia,
                         __m256i& im, float& d, float& dm) {
  KRegs r;
  dec_k_regs<T>(blk, r);
  // the scales of the 16s 2i and 2i + 1 in int16 lanes 0-7 and 8-15: one byte shuffle of a half
  // of sc held in both lanes (a store and 16 scalar broadcasts before: ~10% of a decode step)
  const __m256i halves[2] = {_mm256_permute2x128_si256(r.sc, r.sc, 0x00),
                             _mm256_permute2x128_si256(r.sc, r.sc, 0x11)};
  ia = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i));
    const int j = 4 * (i % 4);  // byte of sc[2i] within its half
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((j + 3) << 8) | (j + 2))),
                                          _mm_set1_epi16(static_cast<int16_t>(((j + 1) << 8) | j)));
    const __m256i s = _mm256_shuffle_epi8(halves[i / 4], pick);
    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(r.u[i], xv), s));
  }
  im = _mm256_madd_epi16(r.mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
  d = r.d;
  dm = r.dm;
}
#endif

// One row (a decode step): an output at a time along its row (one stream for the prefetcher),
// two super-blocks at a time: each decoded in registers straight into its integer sums
// (k_block_sums: no interleaving at one row), the two blocks' four sums reduced into the lanes of
// one vector, then k_micro's float operations in scalar form, block by block: the same integers
// and the same roundings as a lane of the tiles.
template <int64_t T>
void k_gemv(const Q8K& X, int64_t k, float* y, const uint8_t* w, int64_t row_bytes, int64_t o0,
            int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    float f = 0.f;
    for (int64_t b = 0; b < nb; b += 2) {
      __m256i ia0, im0, ia1 = _mm256_setzero_si256(), im1 = _mm256_setzero_si256();
      float d0, dm0, d1 = 0.f, dm1 = 0.f;
      const uint8_t* blk = row + b * B;
      for (int64_t l = 0; l < 2 * B; l += 64) __builtin_prefetch(blk + 16 * B + l);
      k_block_sums<T>(blk, X.q + 256 * b, X.s16 + 16 * b, ia0, im0, d0, dm0);
      const bool two = b + 1 < nb;
      if (two) k_block_sums<T>(blk + B, X.q + 256 * (b + 1), X.s16 + 16 * (b + 1), ia1, im1, d1, dm1);
      // [ia0, im0, ia1, im1] summed: the lanes' pairs, then the halves
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(ia0, im0), _mm256_hadd_epi32(ia1, im1));
      const __m128 v = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
      const float dx0 = X.d[b];
      f = std::fma(_mm_cvtss_f32(v), d0 * dx0, f);
      f = std::fma(-_mm_cvtss_f32(_mm_movehdup_ps(v)), dm0 * dx0, f);
      if (two) {
        const float dx1 = X.d[b + 1];
        f = std::fma(_mm_cvtss_f32(_mm_movehl_ps(v, v)), d1 * dx1, f);
        f = std::fma(-_mm_cvtss_f32(_mm_shuffle_ps(v, v, 3)), dm1 * dx1, f);
      }
    }
    y[col0 + o] = f;
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
#define CELLSERVE_GGML_KCOL16 1
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

template <int64_t T, int MR = kMR16>
inline void k_micro16_rows(int mr, const KCol16* buf, int64_t nkb, const int8_t* x, int64_t k,
                           const float* xd, int64_t nb, const int16_t* xs, __m512* facc, bool first) {
  if constexpr (MR > 1)
    if (mr < MR) return k_micro16_rows<T, MR - 1>(mr, buf, nkb, x, k, xd, nb, xs, facc, first);
  k_micro16<T, MR>(buf, nkb, x, k, xd, nb, xs, facc, first);
}

// k_task's loops with KCol16 columns of 16 outputs
template <int64_t T>
void k_task16(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t row_tile,
              const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  constexpr int64_t B = Fmt<T>::B;
  const int64_t nb = k / 256;
  thread_local std::vector<KCol16> bufv(kKBCol16);
  KCol16* buf = bufv.data();
  alignas(64) __m512 facc[kKTile];
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t nr = std::min(m, r0 + row_tile) - r0;
    for (int64_t og = o0; og < o1; og += 16) {
      const int no = static_cast<int>(std::min<int64_t>(16, o1 - og));
      for (int64_t b0 = 0; b0 < nb; b0 += kKBCol16) {
        const int64_t nkb = std::min(kKBCol16, nb - b0);
        for (int64_t b = 0; b < nkb; ++b) pack_kcol16<T>(w + og * row_bytes + (b0 + b) * B, row_bytes, no, buf[b]);
        for (int64_t rr = 0; rr < nr; rr += kMR16) {
          const int64_t row = r0 + rr;
          k_micro16_rows<T>(static_cast<int>(std::min<int64_t>(kMR16, nr - rr)), buf, nkb, X.q + row * k + b0 * 256,
                            k, X.d + row * nb + b0, nb, X.s16 + row * (k / 16) + b0 * 16, facc + rr, b0 == 0);
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << no) - 1);
      for (int64_t r = 0; r < nr; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * n + col0 + og, mask, facc[r]);
    }
  }
}
#endif
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
#if defined(CELLSERVE_GGML_KCOL16)
constexpr int64_t kTileMR = kMR16;
#elif defined(CELLSERVE_GGML_KCOL)
constexpr int64_t kTileMR = kMR;
#else
constexpr int64_t kTileMR = 1;
#endif

// A task's outputs of a K-quant part: one row goes to k_gemv where this build has one (same bits
// as the tiles, read faster), everything else to the tiles (16 outputs a tile with VNNI).
template <int64_t T>
void k_part(const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
#if defined(CELLSERVE_GGML_KCOL)
  if (m == 1) return k_gemv<T>(X, k, y, w, row_bytes, o0, o1, col0);
#endif
#if defined(CELLSERVE_GGML_KCOL16)
  k_task16<T>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#else
  k_task<T>(X, m, k, n, y, k_tile, w, row_bytes, o0, o1, col0);
#endif
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
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous()
                                                        : x_in.to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
  TORCH_CHECK_VALUE(!any_q || k % kQ == 0, "ggml_linear: k must be a multiple of 32");
  Q8Rows rows{nullptr, nullptr, nullptr};
  if (any_q) rows = quantize_rows(x);
  Q8K krows{nullptr, nullptr, nullptr, nullptr};
  if (any_k) krows = quantize_rows_k(x.data_ptr<float>(), m, k);
  // rows per tile: their int8 values (k bytes a row) within ~32 KB of L1
  const int64_t row_tile = std::clamp<int64_t>(32768 / k, 4, 64);
  const int64_t k_tile = std::max<int64_t>(kTileMR, std::min<int64_t>(kKTile, kKTileBytes / k) / kTileMR * kTileMR);
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
        case Q4_K: k_part<Q4_K>(krows, m, k, n, yp, k_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_K: k_part<Q5_K>(krows, m, k, n, yp, k_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q6_K: k_part<Q6_K>(krows, m, k, n, yp, k_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#if defined(CELLSERVE_GGML_TILE32)
        case Q4_0: q_task<Q4_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q4_1: q_task<Q4_1>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_0: q_task<Q5_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_1: q_task<Q5_1>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q8_0: q_task<Q8_0>(rows, m, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#endif
        default: run_task(L, type, wp, w.size(1), task.o0, task.o1, c0);
      }
    }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
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

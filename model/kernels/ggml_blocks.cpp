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
// The integer path: each activation row is quantized to int8 per 32 values (quantize_rows_q8,
// int4.cpp: d = max|x| / 127 and s = d * the sum of the int8 values), each weight block is
// decoded into int8 values with a float scale per 16 values and, for the kinds with a minimum
// (Q4_1, Q5_1, Q4_K, Q5_K), a float minimum per 32; the offsets of Q4_0 / Q5_0 / Q6_K are taken
// into the decoded values, which are then signed (|q| <= 128: vpsignb moves the sign onto the
// activations, as llama.cpp's AVX2 Q8_0 dot does). Per 32 values the dot product is exact in
// int32 (vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd on AVX2, plain C++ otherwise), in 8
// lanes of 4 values, so that a per-16 scale is a per-lane one; scaled in float32:
//   y[r, o] = sum_blocks sum_lanes scale[lane] * d_x[r, g] * dot + sum_g min[g] * s_x[r, g].
// Tiling: tasks of kOutBlock outputs (parallel); within a task, tiles of rows (sized so that
// their int8 rows stay in L1), within those each output's blocks decoded once into L1 and
// applied to every row of the tile. The float kinds take the same tiling with a float row.
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
  return c10::detail::fp16_ieee_to_fp32_value(bits);
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
using Acc = __m512;
// 16 int32 lanes of 4 products of unsigned bytes u and signed bytes s (2 * |u * s| < 2^15)
inline __m512i dot_u8s8_512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

// output o of a quantized part over rows [r0, r1): each step of 64 values or more (a K
// super-block, or two 32-value blocks) decoded once, then applied to every row, 64 values an
// instruction; the decoded sign moves onto the activations (masked negation); a 32-value block
// left over takes 256-bit vectors.
template <int64_t T>
void rows_q(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
            Acc* acc, float* macc) {
  using F = Fmt<T>;
  constexpr int64_t P = F::E >= 64 ? 1 : 64 / F::E;  // blocks a step
  constexpr int64_t V = F::E * P, NV = V / 64, G = V / kQ;
  constexpr bool kSigned = !F::kHasMin;
  const int64_t groups = L.k / kQ, nr = r1 - r0, nb = L.k / F::E, steps = nb / P;
  alignas(64) int8_t q[V];
  float sc[V / 16], mn[G];
  for (int64_t r = 0; r < nr; ++r) {
    acc[r] = _mm512_setzero_ps();
    macc[r] = 0.f;
  }
  const __m512i lane4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i lane8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t st = 0; st < steps; ++st) {
    _mm_prefetch(reinterpret_cast<const char*>(wrow + (st + 4) * P * F::B), _MM_HINT_T0);
    for (int64_t p = 0; p < P; ++p)
      F::decode(wrow + (st * P + p) * F::B, q + p * F::E, sc + p * (F::E / 16), mn + p * (F::E / kQ));
    __m512i w[NV];
    __mmask64 neg[NV];
    __m512 ws[NV];
    for (int64_t i = 0; i < NV; ++i) {
      const __m512i v = _mm512_load_si512(q + 64 * i);
      if constexpr (kSigned) {
        neg[i] = _mm512_movepi8_mask(v);
        w[i] = _mm512_abs_epi8(v);
      } else {
        w[i] = v;
      }
      ws[i] = _mm512_permutexvar_ps(lane4, _mm512_castps128_ps512(_mm_loadu_ps(sc + 4 * i)));
    }
    __m512 mn8 = _mm512_setzero_ps();
    if constexpr (F::kHasMin && G == 8) mn8 = _mm512_zextps256_ps512(_mm256_loadu_ps(mn));
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + st * G;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const float* xd = L.xq->d + g0;
      __m512 a = acc[r];
      for (int64_t i = 0; i < NV; ++i) {
        __m512i xv = _mm512_loadu_si512(xr + 64 * i);
        if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, neg[i], zero, xv);
        const __m512 d2 = _mm512_permutexvar_ps(
            lane8, _mm512_castps128_ps512(
                       _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xd + 2 * i)))));
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8_512(w[i], xv)), _mm512_mul_ps(ws[i], d2),
                            a);
      }
      if constexpr (F::kHasMin && G == 8) {  // K: the 8 minimums' terms in 8 of the lanes
        a = _mm512_fmadd_ps(mn8, _mm512_zextps256_ps512(_mm256_loadu_ps(L.xq->s + g0)), a);
      } else if constexpr (F::kHasMin) {
        const float* xs = L.xq->s + g0;
        float mm = 0.f;
        for (int64_t g = 0; g < G; ++g) mm += mn[g] * xs[g];
        macc[r] += mm;
      }
      acc[r] = a;
    }
  }
  if (steps * P < nb) {  // one 32-value block left (P == 2, an odd count)
    const int64_t blk = nb - 1;
    F::decode(wrow + blk * F::B, q, sc, mn);
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i w = kSigned ? _mm256_abs_epi8(v) : v;
    const __m256 ws = _mm256_set_m128(_mm_set1_ps(sc[1]), _mm_set1_ps(sc[0]));
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g = (r0 + r) * groups + blk;
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.xq->q + g * kQ));
      if constexpr (kSigned) xv = _mm256_sign_epi8(xv, v);
      const __m256 t = _mm256_mul_ps(dot_u8s8(w, xv), _mm256_mul_ps(ws, _mm256_set1_ps(L.xq->d[g])));
      macc[r] += hsum8(t) + (F::kHasMin ? mn[0] * L.xq->s[g] : 0.f);
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = _mm512_reduce_add_ps(acc[r]) + macc[r];
}

// Q4_K, the common case, decoded in registers (no buffer): its 128 bytes of nibbles as two
// 64-byte vectors, whose low / high nibbles hold sub-blocks (0, 2) / (1, 3) and (4, 6) / (5, 7)
// in 256-bit halves, put in order with one lane shuffle each; the 8 scales times the row's 8
// activation scales in one multiply, spread to 16 lanes per pair of sub-blocks.
template <>
void rows_q<Q4_K>(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
                  Acc* acc, float* macc) {
  const int64_t groups = L.k / kQ, nr = r1 - r0, nb = L.k / 256;
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i pair[4];  // lanes 0-7: sub-block 2i's factor, 8-15: 2i + 1's
  for (int i = 0; i < 4; ++i) pair[i] = _mm512_set_epi32(
      2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
      2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * 144;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144 + 128), _MM_HINT_T0);
    // k_scales' words, in registers: lanes 0-7 d * scale, 8-15 -dmin * minimum
    uint32_t a4, b4, c4;
    std::memcpy(&a4, blk + 4, 4);
    std::memcpy(&b4, blk + 8, 4);
    std::memcpy(&c4, blk + 12, 4);
    const __m128i bytes = _mm_set_epi32(
        static_cast<int>(((c4 >> 4) & 0x0f0f0f0fu) | ((b4 >> 2) & 0x30303030u)),
        static_cast<int>(b4 & 0x3f3f3f3fu),
        static_cast<int>((c4 & 0x0f0f0f0fu) | ((a4 >> 2) & 0x30303030u)),
        static_cast<int>(a4 & 0x3f3f3f3fu));
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(fp16(blk)), _mm256_set1_ps(-fp16(blk + 2)), 1);
    const __m512 sm = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
    const __m512 s8 = sm;
    const __m512 m8 = _mm512_zextps256_ps512(_mm512_extractf32x8_ps(sm, 1));
    __m512i w[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      w[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // sub-blocks 4h, 4h + 1
      w[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // 4h + 2, 4h + 3
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * 8;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const __m512 f = _mm512_mul_ps(s8, _mm512_zextps256_ps512(_mm256_loadu_ps(L.xq->d + g0)));
      __m512 a = _mm512_fmadd_ps(m8, _mm512_zextps256_ps512(_mm256_loadu_ps(L.xq->s + g0)), acc[r]);
      for (int i = 0; i < 4; ++i) {
        const __m512i dot = dot_u8s8_512(w[i], _mm512_loadu_si512(xr + 64 * i));
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pair[i], f), a);
      }
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = _mm512_reduce_add_ps(acc[r]);
  (void)macc;
}

// Q6_K decoded in registers: per half of 128 values, ql's 64 bytes hold sub-blocks (0, 1) in
// their low nibbles and (2, 3) in their high ones, in order; qh's 32 bytes their top 2 bits
// (bits 0-1, 2-3, 4-5, 6-7). Signed values (q - 32): the sign moves onto the activations.
template <>
void rows_q<Q6_K>(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
                  Acc* acc, float* macc) {
  const int64_t groups = L.k / kQ, nr = r1 - r0, nb = L.k / 256;
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3),
                off = _mm512_set1_epi8(32), zero = _mm512_setzero_si512();
  const __m512i lane8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512i quad[4];  // 4 lanes each of the per-16 scales 4i .. 4i + 3
  for (int i = 0; i < 4; ++i)
    quad[i] = _mm512_set_epi32(4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 2, 4 * i + 2,
                               4 * i + 2, 4 * i + 2, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i + 1,
                               4 * i, 4 * i, 4 * i, 4 * i);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * 210;
    for (int l = 0; l < 4; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 210 + 64 * l), _MM_HINT_T0);
    const __m512 s16 = _mm512_mul_ps(
        _mm512_set1_ps(fp16(blk + 208)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
    __m512i w[4];
    __mmask64 neg[4];
    __m512 ws[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i v01 = _mm512_or_si512(
          _mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(hb, two), 4));
      const __m512i v23 = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), two), 4));
      const __m512i s01 = _mm512_sub_epi8(v01, off), s23 = _mm512_sub_epi8(v23, off);
      neg[2 * h] = _mm512_movepi8_mask(s01);
      neg[2 * h + 1] = _mm512_movepi8_mask(s23);
      w[2 * h] = _mm512_abs_epi8(s01);
      w[2 * h + 1] = _mm512_abs_epi8(s23);
    }
    for (int i = 0; i < 4; ++i) ws[i] = _mm512_permutexvar_ps(quad[i], s16);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * 8;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const __m512 d8 = _mm512_zextps256_ps512(_mm256_loadu_ps(L.xq->d + g0));
      __m512 a = acc[r];
      for (int i = 0; i < 4; ++i) {
        __m512i xv = _mm512_loadu_si512(xr + 64 * i);
        xv = _mm512_mask_sub_epi8(xv, neg[i], zero, xv);
        const __m512 d2 = _mm512_permutexvar_ps(_mm512_add_epi32(lane8, _mm512_set1_epi32(2 * i)), d8);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8_512(w[i], xv)), _mm512_mul_ps(ws[i], d2), a);
      }
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = _mm512_reduce_add_ps(acc[r]);
  (void)macc;
}
#elif defined(__AVX2__) && defined(__FMA__)
using Acc = __m256;
// output o of a quantized part over rows [r0, r1): decode each block once, apply it to every row
// (the decoded sign moves onto the activations: vpsignb)
template <int64_t T>
void rows_q(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
            Acc* acc, float* macc) {
  using F = Fmt<T>;
  constexpr int64_t S = F::E / kQ;  // 32-value groups per block
  constexpr bool kSigned = !F::kHasMin;
  const int64_t groups = L.k / kQ, nr = r1 - r0;
  alignas(64) int8_t q[F::E];
  float sc[F::E / 16], mn[S];
  for (int64_t r = 0; r < nr; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.f;
  }
  for (int64_t b = 0; b < L.k / F::E; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(wrow + (b + 4) * F::B), _MM_HINT_T0);
    F::decode(wrow + b * F::B, q, sc, mn);
    __m256i w[S], sgn[S];
    __m256 ws[S];
    for (int64_t s = 0; s < S; ++s) {
      sgn[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + s * kQ));
      w[s] = kSigned ? _mm256_abs_epi8(sgn[s]) : sgn[s];
      ws[s] = _mm256_set_m128(_mm_set1_ps(sc[2 * s + 1]), _mm_set1_ps(sc[2 * s]));
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * S;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const float* xd = L.xq->d + g0;
      __m256 a = acc[r];
      for (int64_t s = 0; s < S; ++s) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + s * kQ));
        if constexpr (kSigned) xv = _mm256_sign_epi8(xv, sgn[s]);
        a = _mm256_fmadd_ps(dot_u8s8(w[s], xv), _mm256_mul_ps(ws[s], _mm256_set1_ps(xd[s])), a);
      }
      if constexpr (F::kHasMin && S == 8) {  // K: the 8 minimums' terms, one a lane
        a = _mm256_fmadd_ps(_mm256_loadu_ps(mn), _mm256_loadu_ps(L.xq->s + g0), a);
      } else if constexpr (F::kHasMin) {
        const float* xs = L.xq->s + g0;
        float mm = 0.f;
        for (int64_t s = 0; s < S; ++s) mm += mn[s] * xs[s];
        macc[r] += mm;
      }
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = hsum8(acc[r]) + macc[r];
}

// Q4_K decoded in registers: chunk c of 32 bytes holds sub-block 2c in its low nibbles, 2c + 1
// in its high ones; the 8 scales and minimums converted together (k_scales' words).
template <>
void rows_q<Q4_K>(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
                  Acc* acc, float* macc) {
  const int64_t groups = L.k / kQ, nr = r1 - r0, nb = L.k / 256;
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * 144;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * 144 + 128), _MM_HINT_T0);
    uint32_t a4, b4, c4;
    std::memcpy(&a4, blk + 4, 4);
    std::memcpy(&b4, blk + 8, 4);
    std::memcpy(&c4, blk + 12, 4);
    const __m128i bytes = _mm_set_epi32(
        static_cast<int>(((c4 >> 4) & 0x0f0f0f0fu) | ((b4 >> 2) & 0x30303030u)),
        static_cast<int>(b4 & 0x3f3f3f3fu),
        static_cast<int>((c4 & 0x0f0f0f0fu) | ((a4 >> 2) & 0x30303030u)),
        static_cast<int>(a4 & 0x3f3f3f3fu));
    const __m256 s8 =
        _mm256_mul_ps(_mm256_set1_ps(fp16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(-fp16(blk + 2)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
    __m256i w[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
      w[2 * c] = _mm256_and_si256(v, low4);
      w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * 8;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const __m256 f = _mm256_mul_ps(s8, _mm256_loadu_ps(L.xq->d + g0));
      __m256 a = _mm256_fmadd_ps(m8, _mm256_loadu_ps(L.xq->s + g0), acc[r]);
      for (int sb = 0; sb < 8; ++sb) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + kQ * sb));
        a = _mm256_fmadd_ps(dot_u8s8(w[sb], xv),
                            _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(sb)), a);
      }
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = hsum8(acc[r]);
  (void)macc;
}
// (Q6_K on AVX2 keeps the buffered decode: decoded in registers, its 8 signed and 8 absolute
// vectors spill, and batches ran slower than through the buffer.)
#else
using Acc = float;  // 8 a row
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
  for (int64_t r = 0; r < nr; ++r) {
    float t = 0.f;
    for (int lane = 0; lane < 8; ++lane) t += acc[8 * r + lane];
    y_col[(r0 + r) * L.n] = t + macc[r];
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
        case Q4_K: rows_q<Q4_K>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q5_K: rows_q<Q5_K>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q6_K: rows_q<Q6_K>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
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
  bool any_q = false, any_f = false;
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_weight(parts[i], types[i], k, "ggml_linear");
    (type_info(types[i]).quantized ? any_q : any_f) = true;
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
  // rows per tile: their int8 values (k bytes a row) within ~32 KB of L1
  const int64_t row_tile = std::clamp<int64_t>(32768 / k, 4, 64);
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
      run_task(L, types[task.part], w.data_ptr<uint8_t>(), w.size(1), task.o0, task.o1,
               col0[task.part]);
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

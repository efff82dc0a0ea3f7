// The GGUF block formats (llama.cpp's, as a file stores them; their layouts head
// ggml_blocks.cpp) and the K-quant kernels' entry points: shared by ggml_blocks.cpp
// (ggml_linear, ggml_get_rows, ggml_dequantize, the 32-value kinds' kernels) and
// ggml_kquants.cpp (the Q4_K, Q5_K and Q6_K kernels).
#pragma once

#include "kernels.h"

#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CELLSERVE_GGML_ZMM 1
#endif

namespace ggml {

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
  MXFP4 = 39,
  // not GGML types: Q4_K's bytes moved 16 (8) outputs a group (ggml_krepack.h, ggml_repack) for
  // the AVX-512 VNNI (the other AVX2) builds; ggml_linear computes on them, nothing else reads them
  Q4_K_X16 = 1012,
  Q4_K_X8 = 2012,
};

inline bool is_k(int64_t type) {
  return type == Q4_K || type == Q5_K || type == Q6_K || type == Q4_K_X16 || type == Q4_K_X8;
}

struct TypeInfo {
  int64_t elems, bytes;
  bool quantized;
};

inline TypeInfo type_info(int64_t type) {
  switch (type) {
    case F32: return {1, 4, false};
    case F16: return {1, 2, false};
    case BF16: return {1, 2, false};
    case Q4_0: return {32, 18, true};
    case Q4_1: return {32, 20, true};
    case Q5_0: return {32, 22, true};
    case Q5_1: return {32, 24, true};
    case Q8_0: return {32, 34, true};
    case MXFP4: return {32, 17, true};
    case Q4_K: return {256, 144, true};
    case Q4_K_X16:
    case Q4_K_X8: return {256, 144, true};
    case Q5_K: return {256, 176, true};
    case Q6_K: return {256, 210, true};
    default:
      TORCH_CHECK_VALUE(false, "ggml: GGML type ", type,
                        " is not supported (F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, "
                        "Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14, BF16=30, MXFP4=39)");
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

// MXFP4 (OCP microscaling, gpt-oss's experts): 32 FP4 (E2M1) values sharing an E8M0 scale. As
// llama.cpp: each 4-bit code is twice its E2M1 value (kMxfp4), the scale half of 2^(e - 127);
// a value is exactly kMxfp4[code] * e8m0_half(e).
constexpr int8_t kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {  // 2^(e - 128), subnormal for e < 2
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <>
struct Fmt<MXFP4> {
  static constexpr int64_t E = 32, B = 17;
  static constexpr bool kHasMin = false;
  static void decode(const uint8_t* b, int8_t* q, float* sc, float*) {
    const uint8_t* qs = b + 1;
    for (int j = 0; j < 16; ++j) {
      q[j] = kMxfp4[qs[j] & 0x0F];
      q[16 + j] = kMxfp4[qs[j] >> 4];
    }
    sc[0] = sc[1] = e8m0_half(b[0]);
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

// ---- the K-quants' entry points (ggml_kquants.cpp) ----

// activation rows quantized per 256 values, as llama.cpp's q8_K
struct Q8K {
  const int8_t* q;     // [m, k]
  const float* d;      // [m, k / 256]
  const float* mx;     // [m, k / 16]: d * the sum of each 16 int8 values
  const int16_t* s16;  // [m, k / 16]: the sums themselves
  const int16_t* s32;  // [m, k / 32]: the sums of each 32 (the repacked micro-kernels' minimums)
};

// x [m, k] float32 -> this thread's Q8K buffers (valid until its next call)
Q8K quantize_rows_k(const float* x, int64_t m, int64_t k);

// the rows of a K-quant tile at k inputs
int64_t k_tile_rows(int64_t k);

// outputs [o0, o1) of a K-quant part of type (its rows row_bytes apart at w) for every row of X
// -> y[:, col0 + o0 .. col0 + o1) (y: n columns); k_tile: k_tile_rows(k)
void k_part(int64_t type, const Q8K& X, int64_t m, int64_t k, int64_t n, float* y, int64_t k_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0);

// the repacked Q4_K this build computes on (Q4_K_X16, Q4_K_X8; 0: none) and its outputs a group;
// n Q4_K rows at src (row_bytes each, n a multiple of the group) moved into it at dst
int64_t repack_type();
// whether the K-quants' prompt chunks run on AMX (ggml_kamx.h); mode 0 / 1 switches it off / on
// (on only where the CPU and the kernel allow it), -1 only asks
bool amx_mode(int64_t mode);
int64_t repack_lanes();
void repack_q4k(const uint8_t* src, uint8_t* dst, int64_t n, int64_t row_bytes);

}  // namespace ggml

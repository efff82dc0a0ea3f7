// K/V rows in the cache types of kvcache/cache_types.py (llama.cpp's --cache-type-k/-v): the
// attention kernels read rows of any type through dequant_row, and step_layers stores rows
// through encode_row. q8_0 / q4_0 are ggml's blocks of 32 (block_q8_0: fp16 d + 32 int8;
// block_q4_0: fp16 d + 16 bytes, element j in the low and j + 16 in the high nibble of byte j),
// quantized as ggml's reference (quantize_row_q8_0_ref / quantize_row_q4_0_ref) does.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

namespace {

constexpr int64_t kQK = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline void store_half(uint8_t* p, float x) {
  const uint16_t bits = c10::detail::fp16_ieee_from_fp32_value(x);
  std::memcpy(p, &bits, 2);
}

void dequant_q8_0(const uint8_t* src, float* dst, int64_t hd) {
  for (int64_t b = 0; b < hd / kQK; ++b, src += 2 + kQK, dst += kQK) {
    const float d = half_to_float(src);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
#if defined(CELLSERVE_F32_AVX2)
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < kQK; i += 8) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), vd));
    }
#else
    for (int i = 0; i < kQK; ++i) dst[i] = static_cast<float>(q[i]) * d;
#endif
  }
}

void dequant_q4_0(const uint8_t* src, float* dst, int64_t hd) {
  for (int64_t b = 0; b < hd / kQK; ++b, src += 2 + kQK / 2, dst += kQK) {
    const float d = half_to_float(src);
    const uint8_t* qs = src + 2;
#if defined(CELLSERVE_F32_AVX2)
    const __m256 vd = _mm256_set1_ps(d);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int i = 0; i < kQK / 2; i += 8) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + i)));
      const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)), eight);
      const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight);
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), vd));
      _mm256_storeu_ps(dst + kQK / 2 + i, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), vd));
    }
#else
    for (int i = 0; i < kQK / 2; ++i) {
      dst[i] = static_cast<float>((qs[i] & 0x0F) - 8) * d;
      dst[i + kQK / 2] = static_cast<float>((qs[i] >> 4) - 8) * d;
    }
#endif
  }
}

void dequant_f16(const uint8_t* src, float* dst, int64_t hd) {
  int64_t i = 0;
#if defined(CELLSERVE_F32_AVX2)  // x86-64-v3 has F16C
  for (; i + 8 <= hd; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
#endif
  for (; i < hd; ++i) dst[i] = half_to_float(src + 2 * i);
}

void dequant_bf16(const uint8_t* src, float* dst, int64_t hd) {
  const auto* p = reinterpret_cast<const at::BFloat16*>(src);
  for (int64_t i = 0; i < hd; ++i) dst[i] = to_float(p[i]);
}

void quant_q8_0(const float* x, uint8_t* dst, int64_t hd) {
  for (int64_t b = 0; b < hd / kQK; ++b, x += kQK, dst += 2 + kQK) {
    float amax = 0.0f;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_half(dst, d);
    int8_t* q = reinterpret_cast<int8_t*>(dst + 2);
    for (int i = 0; i < kQK; ++i) q[i] = static_cast<int8_t>(std::roundf(x[i] * id));
  }
}

void quant_q4_0(const float* x, uint8_t* dst, int64_t hd) {
  for (int64_t b = 0; b < hd / kQK; ++b, x += kQK, dst += 2 + kQK / 2) {
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < kQK; ++i)
      if (amax < std::fabs(x[i])) {
        amax = std::fabs(x[i]);
        mx = x[i];
      }
    const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_half(dst, d);
    for (int i = 0; i < kQK / 2; ++i) {
      const int lo = std::min(15, static_cast<int>(x[i] * id + 8.5f));
      const int hi = std::min(15, static_cast<int>(x[i + kQK / 2] * id + 8.5f));
      dst[2 + i] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

}  // namespace

CacheKind cache_kind(const at::Tensor& rows, int64_t hd) {
  switch (rows.scalar_type()) {
    case at::kFloat:
      return CacheKind::F32;
    case at::kHalf:
      return CacheKind::F16;
    case at::kBFloat16:
      return CacheKind::BF16;
    case at::kByte:
      if (hd % kQK == 0 && rows.size(-1) == hd / kQK * (2 + kQK)) return CacheKind::Q8_0;
      if (hd % kQK == 0 && rows.size(-1) == hd / kQK * (2 + kQK / 2)) return CacheKind::Q4_0;
      break;
    default:
      break;
  }
  TORCH_CHECK(false, "K/V rows of dtype ", rows.scalar_type(), " [..., ", rows.size(-1),
              "] are no cache type for head_dim ", hd,
              " (f32, f16, bf16, or uint8 rows of q8_0 / q4_0 blocks)");
}

void dequant_row(CacheKind kind, const uint8_t* src, float* dst, int64_t hd) {
  switch (kind) {
    case CacheKind::F32:
      std::memcpy(dst, src, hd * sizeof(float));
      return;
    case CacheKind::F16:
      return dequant_f16(src, dst, hd);
    case CacheKind::BF16:
      return dequant_bf16(src, dst, hd);
    case CacheKind::Q8_0:
      return dequant_q8_0(src, dst, hd);
    case CacheKind::Q4_0:
      return dequant_q4_0(src, dst, hd);
  }
}

void dequant_row(CacheKind kind, const uint8_t* src, at::BFloat16* dst, int64_t hd) {
  if (kind == CacheKind::BF16) {
    std::memcpy(dst, src, hd * 2);
    return;
  }
#ifdef CELLSERVE_AVX512_BF16
  // straight to bfloat16, 32 values a block: the same float32 values as dequant_row's (an exact
  // int8 -> float conversion times the block's scale, or fp16 -> float32), rounded to nearest
  // even as to_bf16 rounds them, with no float32 row in between (the attention kernels decode
  // each row as they read it: attend_bf16_coded)
  if (kind == CacheKind::Q8_0 || kind == CacheKind::Q4_0 || (kind == CacheKind::F16 && hd % kQK == 0)) {
    auto* out = reinterpret_cast<__m512i*>(dst);
    for (int64_t b = 0; b < hd / kQK; ++b) {
      __m512 lo, hi;
      if (kind == CacheKind::F16) {
        lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32)));
        src += 2 * kQK;
      } else {
        const __m512 d = _mm512_set1_ps(half_to_float(src));
        __m512i qlo, qhi;
        if (kind == CacheKind::Q8_0) {
          qlo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2)));
          qhi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 18)));
          src += 2 + kQK;
        } else {
          const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2)));
          const __m512i eight = _mm512_set1_epi32(8);
          qlo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight);
          qhi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
          src += 2 + kQK / 2;
        }
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(qlo), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qhi), d);
      }
      _mm512_storeu_si512(out + b, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return;
  }
#endif
  float row[32 * kMaxChunks];
  TORCH_CHECK(hd <= 32 * kMaxChunks, "head_dim ", hd, " past ", 32 * kMaxChunks);
  dequant_row(kind, src, row, hd);
  to_bf16(row, dst, hd);
}

void encode_row(CacheKind kind, const float* x, uint8_t* dst, int64_t hd) {
  switch (kind) {
    case CacheKind::F32:
      std::memcpy(dst, x, hd * sizeof(float));
      return;
    case CacheKind::F16:
      for (int64_t i = 0; i < hd; ++i) store_half(dst + 2 * i, x[i]);
      return;
    case CacheKind::BF16: {
      auto* p = reinterpret_cast<at::BFloat16*>(dst);
      for (int64_t i = 0; i < hd; ++i) p[i] = at::BFloat16(x[i]);
      return;
    }
    case CacheKind::Q8_0:
      return quant_q8_0(x, dst, hd);
    case CacheKind::Q4_0:
      return quant_q4_0(x, dst, hd);
  }
}

int64_t cache_row_bytes(CacheKind kind, int64_t hd) {
  switch (kind) {
    case CacheKind::F32:
      return 4 * hd;
    case CacheKind::F16:
    case CacheKind::BF16:
      return 2 * hd;
    case CacheKind::Q8_0:
      return hd / kQK * (2 + kQK);
    case CacheKind::Q4_0:
      return hd / kQK * (2 + kQK / 2);
  }
  return 0;
}

// the rows of `cells` [n] of one layer's cache [n_kv, n_cells, row] (contiguous), dequantized
// -> [n_kv, n, hd] in `dtype` (float32 or bfloat16): what prompt_attention reads when the cache
// is not the model's dtype (once per chunk, not once per task)
at::Tensor dequant_cells(const at::Tensor& rows, const at::Tensor& cells, int64_t hd,
                         at::ScalarType dtype) {
  const CacheKind kind = cache_kind(rows, hd);
  TORCH_CHECK(rows.is_contiguous(), "dequant_cells: the cache must be contiguous");
  const int64_t n_kv = rows.size(0), n_cells = rows.size(1), n = cells.numel();
  const int64_t row = cache_row_bytes(kind, hd);
  const int64_t* cp = cells.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] < n_cells, "dequant_cells: cell ", cp[i], " out of range");
  auto out = at::empty({n_kv, n, hd}, rows.options().dtype(dtype));
  const auto* base = static_cast<const uint8_t*>(rows.data_ptr());
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(bf16 || dtype == at::kFloat, "dequant_cells: to float32 or bfloat16");
  at::parallel_for(0, n_kv * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / n, i = t % n;
      const uint8_t* src = base + (h * n_cells + cp[i]) * row;
      if (bf16)
        dequant_row(kind, src, out.data_ptr<at::BFloat16>() + t * hd, hd);
      else
        dequant_row(kind, src, out.data_ptr<float>() + t * hd, hd);
    }
  });
  return out;
}

bool reads_cache_types() { return true; }

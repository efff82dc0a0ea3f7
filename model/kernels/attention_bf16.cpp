// The bfloat16 attention kernel (AVX-512 BF16: the avx512_bf16 build) behind attention.cpp's
// decode_attention and prompt_attention for bfloat16 models; kernels.h declares it.
#include "kernels.h"

#include <algorithm>

#ifdef CELLSERVE_AVX512_BF16
namespace {

// out lane i = the sum of the 16 lanes of a[i] (a 16x16 transpose folded into adds: 45 ops for
// 16 dot products instead of 16 horizontal reductions).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
}

constexpr int64_t kPairsAhead = 16;  // V rows prefetched ahead

// Where a task's K or V rows come from: InPlace, bfloat16 rows read where they are in the cache,
// or CodedRows (kernels.h), rows of another cache type (f16, q8_0, q4_0) decoded one at a time
// into a scratch row (16 K rows or 2 V rows live at once: L1, where a whole sequence's rows
// decoded first would not fit in L2 at a long context).
struct InPlace {
  const at::BFloat16* base;
  int64_t stride, hd;
  const at::BFloat16* row(int64_t cell, at::BFloat16*) const { return base + cell * stride; }
  void prefetch(int64_t cell) const { prefetch_row(base + cell * stride, hd); }
};


template <typename Rows>
void attend(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
            const int64_t* qfirsts, int64_t hd,
            const Rows& krows, const Rows& vrows, const int64_t* sc, int64_t n, float scale,
            float softcap, const float* sinks, float* scores, at::BFloat16* const* dst);

}  // namespace

// One task: nq bfloat16 query vectors that share one kv head, over the K/V rows of cells
// sc[0, n), head_dim % 32 == 0; query g sees the first qlens[g] of them (qlens null: all n),
// from its qfirsts[g] on (qfirsts null: from 0; a sliding window's prompt rows).
// Scores by vdpbf16ps over blocks of 16 rows (bf16 pairs, float32 sums; q is bf16 already),
// softmax in float32, then P V by vdpbf16ps over row pairs with float32 sums. Rows are
// prefetched ahead (both 64-byte lines): a sequence's decode cells are scattered between other
// sequences'. scores: room for nq * (n + 1) floats.
void attend_bf16(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
                 const int64_t* qfirsts, int64_t hd,
                 const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t kstride,
                 int64_t vstride, const int64_t* sc, int64_t n, float scale, float softcap,
                 const float* sinks, float* scores, at::BFloat16* const* dst) {
  attend(qrows, nq, qlens, qfirsts, hd, InPlace{kbase, kstride, hd}, InPlace{vbase, vstride, hd},
         sc, n, scale, softcap, sinks, scores, dst);
}

// The same over rows of other cache types (kbytes / vbytes: bytes between cells): each row
// decoded to bfloat16 as dequant_row does, so the output equals attend_bf16 over those rows.
void attend_bf16_coded(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
                       const int64_t* qfirsts, int64_t hd, CacheKind kkind,
                       const uint8_t* kbase, int64_t kbytes, CacheKind vkind, const uint8_t* vbase, int64_t vbytes, const int64_t* sc,
                       int64_t n, float scale, float softcap, const float* sinks, float* scores,
                       at::BFloat16* const* dst) {
  using Coded = CodedRows<at::BFloat16>;
  attend(qrows, nq, qlens, qfirsts, hd, Coded{kbase, kbytes, hd, kkind},
         Coded{vbase, vbytes, hd, vkind}, sc, n, scale, softcap, sinks, scores, dst);
}

namespace {

template <typename Rows>
void attend(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
            const int64_t* qfirsts, int64_t hd,
            const Rows& krows, const Rows& vrows, const int64_t* sc, int64_t n, float scale,
            float softcap, const float* sinks, float* scores, at::BFloat16* const* dst) {
  alignas(64) at::BFloat16 scratch[16 * 32 * kMaxChunks];  // Coded's rows (InPlace: unused)
  const int64_t chunks = hd / 32, ns = n + (n & 1);  // ns: scores row stride (pairs)
  __m512bh q[kMaxQueries][kMaxChunks];
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      q[g][c] = (__m512bh)_mm512_loadu_si512(qrows[g] + 32 * c);
  const __m512 vscale = _mm512_set1_ps(scale);
  // every score goes through the same blocks and sum16, the last block masked (its missing
  // rows repeat row n - 1, unstored): a row's scores do not depend on n, so a prompt row's
  // output does not depend on the rows it shares a task with
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t valid = std::min<int64_t>(16, n - j);
    const at::BFloat16* rows[16];
    for (int r = 0; r < 16; ++r) {
      rows[r] = r < valid ? krows.row(sc[j + r], scratch + r * hd) : rows[valid - 1];
      if (j + 16 + r < n) krows.prefetch(sc[j + 16 + r]);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
    for (int64_t g = 0; g < nq; ++g) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          a = _mm512_dpbf16_ps(a, q[g][c], (__m512bh)_mm512_loadu_si512(rows[r] + 32 * c));
        acc[r] = a;
      }
      _mm512_mask_storeu_ps(scores + g * ns + j, keep, _mm512_mul_ps(sum16(acc), vscale));
    }
  }
  for (int64_t i = 0; i < std::min(n, kPairsAhead); ++i)  // V's first rows, during the softmax
    vrows.prefetch(sc[i]);
  for (int64_t g = 0; g < nq; ++g) {
    // rows before qfirsts[g], past qlens[g] and the last pair's pad row get weight 0 (no
    // infinities: -ffast-math)
    float* sg = scores + g * ns;
    const int64_t m = qlens == nullptr ? n : qlens[g], f = qfirsts == nullptr ? 0 : qfirsts[g];
    softcap_inplace(sg + f, m - f, softcap);
    softmax_inplace(sg + f, m - f, sinks != nullptr ? sinks + g : nullptr);
    std::fill(sg, sg + f, 0.0f);
    for (int64_t i = m; i < ns; ++i) sg[i] = 0.0f;
  }
  // P V by vdpbf16ps over row pairs: p rounds to bfloat16 as in the torch path (probs.to(v));
  // unpacklo/hi_epi16 interleave two rows, so lane k of acc[g][c][h] is dim 8 * (k / 4) + k % 4
  // (+ 4 for h = 1) of chunk c; fixed below.
  __m512 acc[kMaxQueries][kMaxChunks][2];
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if (i + kPairsAhead < n) vrows.prefetch(sc[i + kPairsAhead]);
    if (i + kPairsAhead + 1 < n) vrows.prefetch(sc[i + kPairsAhead + 1]);
    const at::BFloat16* r0 = vrows.row(sc[i], scratch);
    const at::BFloat16* r1 = i + 1 < n ? vrows.row(sc[i + 1], scratch + hd) : r0;
    __m512bh p[kMaxQueries];
    for (int64_t g = 0; g < nq; ++g) {  // two probabilities -> one bf16 pair in every lane
      const float* sg = scores + g * ns;
      const uint32_t lo = at::BFloat16(sg[i]).x, hi = at::BFloat16(sg[i + 1]).x;
      p[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo | (hi << 16)));
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t g = 0; g < nq; ++g) {
        acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], lo, p[g]);
        acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], hi, p[g]);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 x0 = _mm512_permutex2var_ps(acc[g][c][0], first, acc[g][c][1]);
      const __m512 x1 = _mm512_permutex2var_ps(acc[g][c][0], second, acc[g][c][1]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[g] + 32 * c),
                          (__m256i)_mm512_cvtneps_pbh(x0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[g] + 32 * c + 16),
                          (__m256i)_mm512_cvtneps_pbh(x1));
    }
}

}  // namespace
#endif

bool has_bf16_kernels() {
#ifdef CELLSERVE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// The float32 attention kernel (AVX2 + FMA: the avx2 build and above) behind attention.cpp's
// decode_attention and prompt_attention for float32 models; kernels.h declares it.
#include "kernels.h"

#include <algorithm>

#ifdef CELLSERVE_F32_AVX2
namespace {

// e^x for x <= 0 (softmax's shifted scores), 8 lanes: 2^n * p(r), r = x - n ln 2 in
// [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7); below -87 it returns 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.38888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// softmax over s[0, m) in place, 8 lanes at a time; `sink` as softmax_inplace's
inline void softmax_f32(float* s, int64_t m, const float* sink) {
  float mx = s[0];
  for (int64_t i = 1; i < m; ++i) mx = std::max(mx, s[i]);
  if (sink != nullptr) mx = std::max(mx, *sink);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum) + (sink != nullptr ? std::exp(*sink - mx) : 0.0f);
  for (; i < m; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= m; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < m; ++i) s[i] *= 1.0f / sum;
}

// Where a task's K or V rows come from: InPlace, float32 rows read where they are in the cache,
// or CodedRows (kernels.h), rows of another cache type decoded one at a time into a scratch row.
struct InPlace {
  const float* base;
  int64_t stride;
  const float* row(int64_t cell, float*) const { return base + cell * stride; }
  void prefetch(int64_t cell) const { __builtin_prefetch(base + cell * stride); }
};


constexpr int64_t kMaxVec = 32;  // hd / 8 accumulators, hd <= 256
constexpr int64_t kBlock = 16;   // V rows read (or decoded) together for every query

// Scores 4 rows at a time per head (the 4 dot products reduced together), softmax with a vector
// exp, then the V rows weighted into hd / 8 accumulators per head, kBlock rows at a time: a
// block's rows are read (decoded) once for all `group` queries, whose sums wait in accs between
// blocks (the same additions in the same order as one pass over the rows).
template <typename Rows>
void attend(const float* q, int64_t group, const int64_t* qlens, const int64_t* qfirsts,
            int64_t hd, const Rows& krows, const Rows& vrows, const int64_t* cells, int64_t n, float softcap, const float* sinks,
            float* scores, float* const* out) {
  alignas(32) float scratch[kBlock * 8 * kMaxVec];  // Coded's rows (InPlace: unused)
  alignas(32) float accs[kMaxQueries * 8 * kMaxVec];
  // a partial last block repeats its last row (the same operations for every score, so a
  // query's values do not depend on n)
  for (int64_t j = 0; j < n; j += 4) {
    const int64_t valid = std::min<int64_t>(4, n - j);
    const float* kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = i < valid ? krows.row(cells[j + i], scratch + i * hd) : kr[valid - 1];
    if (j + 4 + kAhead <= n)
      for (int i = 0; i < 4; ++i) krows.prefetch(cells[j + kAhead + i]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * hd;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[3] + d), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      alignas(16) float four[4];
      _mm_store_ps(four, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      for (int64_t i = 0; i < valid; ++i) scores[g * n + j + i] = four[i];
    }
  }
  int64_t most = 0;  // rows any query sees
  for (int64_t g = 0; g < group; ++g) {
    const int64_t m = qlens ? qlens[g] : n, f = qfirsts ? qfirsts[g] : 0;
    softcap_inplace(scores + g * n + f, m - f, softcap);
    softmax_f32(scores + g * n + f, m - f, sinks != nullptr ? sinks + g : nullptr);
    most = std::max(most, m);
  }
  const int64_t nv = hd / 8;
  std::fill(accs, accs + group * hd, 0.0f);
  for (int64_t r0 = 0; r0 < most; r0 += kBlock) {
    const int64_t r1 = std::min(most, r0 + kBlock);
    const float* vr[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      if (r + kAhead < most) vrows.prefetch(cells[r + kAhead]);
      vr[r - r0] = vrows.row(cells[r], scratch + (r - r0) * hd);
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t end = std::min(r1, qlens ? qlens[g] : n);
      if (end <= r0) continue;
      const float* p = scores + g * n;
      float* ag = accs + g * hd;
      __m256 acc[kMaxVec];
      for (int64_t d = 0; d < nv; ++d) acc[d] = _mm256_load_ps(ag + 8 * d);
      for (int64_t r = std::max(r0, qfirsts ? qfirsts[g] : 0); r < end; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r]);
        for (int64_t d = 0; d < nv; ++d)
          acc[d] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr[r - r0] + 8 * d), acc[d]);
      }
      for (int64_t d = 0; d < nv; ++d) _mm256_store_ps(ag + 8 * d, acc[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) std::memcpy(out[g], accs + g * hd, hd * sizeof(float));
}

}  // namespace

// One task in float32, head_dim % 8 == 0: `group` query vectors (q, scaled, [group, hd]: a kv
// head's query heads, of one decode row or of a block of prompt rows) over the first n K/V rows
// read in place at cells (query g over its first qlens[g] <= n, where qlens is given, from its
// qfirsts[g] < qlens[g] on, where qfirsts is given: a sliding window's prompt rows);
// out[g] <- attention output of query g. SmolLM2 (hd 64, 3 query heads per kv head), 32
// sequences x 330 cells x 30 layers, 1 thread: ~5x the scalar loop's speed.
void attend_f32(const float* q, int64_t group, const int64_t* qlens, const int64_t* qfirsts,
                int64_t hd, const float* kbase, const float* vbase, int64_t ks1, int64_t vs1,
                const int64_t* cells, int64_t n, float softcap, const float* sinks,
                float* scores, float* const* out) {
  attend(q, group, qlens, qfirsts, hd, InPlace{kbase, ks1}, InPlace{vbase, vs1}, cells, n, softcap,
         sinks, scores, out);
}

// The same over rows of other cache types (kbytes / vbytes: bytes between cells), each row
// decoded to float32 when it is read, as dequant_row decodes it.
void attend_f32_coded(const float* q, int64_t group, const int64_t* qlens,
                      const int64_t* qfirsts, int64_t hd, CacheKind kkind,
                      const uint8_t* kbase, int64_t kbytes, CacheKind vkind, const uint8_t* vbase,
                      int64_t vbytes, const int64_t* cells, int64_t n,
                      float softcap, const float* sinks, float* scores, float* const* out) {
  using Coded = CodedRows<float>;
  attend(q, group, qlens, qfirsts, hd, Coded{kbase, kbytes, hd, kkind},
         Coded{vbase, vbytes, hd, vkind}, cells, n, softcap, sinks, scores, out);
}
#endif

// whether prompt_attention takes float32 (the AVX2 kernel: the avx2 build and above)
bool has_f32_kernels() {
#ifdef CELLSERVE_F32_AVX2
  return true;
#else
  return false;
#endif
}

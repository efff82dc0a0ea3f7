// CPU attention kernels over the cell cache (built by model/kernels/__init__.py, with
// layers.cpp, into one extension).
//
// decode_attention: attention reading K/V from the cells in place (no gather).
//
// q:     [n_seq, n_heads, head_dim]            float32 or bfloat16 (the cache's dtype)
// k, v:  [n_kv_heads, n_cells, head_dim]       one layer of KVStorage (head-major), any
//                                              strides with a contiguous last dim
// cells: [n_seq, max_kv] int64                 the cells sequence s attends, padded
// lens:  [n_seq] int64                         how many of cells[s] it attends (>= 1)
// -> [n_seq, n_heads, head_dim] in q's dtype; query head h reads kv head h / (n_heads / n_kv_heads)
// (GQA as in HF's repeat_kv). Scores, softmax and the weighted sum are float32. Tasks are
// (sequence, kv head) pairs over at::parallel_for (the build passes -fopenmp: without it the
// OpenMP pragma in ATen/ParallelOpenMP.h compiles away and the kernel runs on one thread).
// bfloat16 with head_dim % 32 == 0 on a CPU with AVX-512 BF16 takes attend_bf16: 30 layers of
// 32 sequences x 330 scattered cells in 14-16 ms, against ~60 for the generic loop below.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CELLSERVE_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kAhead = 8;  // rows prefetched ahead: cells are scattered, not streamed

// s[0, m) -> softmax(s) in place, float32 (m >= 1)
inline void softmax_inplace(float* s, int64_t m) {
  float mx = s[0];
  for (int64_t i = 1; i < m; ++i) mx = std::max(mx, s[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < m; ++i) s[i] *= inv;
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

#if defined(__AVX2__) && defined(__FMA__)
#define CELLSERVE_F32_AVX2 1
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

// softmax over s[0, m) in place, 8 lanes at a time
inline void softmax_f32(float* s, int64_t m) {
  float mx = s[0];
  for (int64_t i = 1; i < m; ++i) mx = std::max(mx, s[i]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (; i < m; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= m; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < m; ++i) s[i] *= 1.0f / sum;
}

// One task in float32, head_dim % 8 == 0: `group` query vectors (q, scaled, [group, hd]: a kv
// head's query heads, of one decode row or of a block of prompt rows) over the first n K/V rows
// read in place at cells (query g over its first qlens[g] <= n, where qlens is given);
// out[g] <- attention output of query g.
// Scores 4 rows at a time per head (the 4 dot products reduced together), softmax with a vector
// exp, then the V rows weighted into hd / 8 accumulators per head. SmolLM2 (hd 64, 3 query heads
// per kv head), 32 sequences x 330 cells x 30 layers, 1 thread: ~5x the scalar loop's speed.
void attend_f32(const float* q, int64_t group, const int64_t* qlens, int64_t hd,
                const float* kbase, const float* vbase, int64_t ks1, int64_t vs1,
                const int64_t* cells, int64_t n, float* scores, float* const* out) {
  // a partial last block repeats its last row (the same operations for every score, so a
  // query's values do not depend on n)
  for (int64_t j = 0; j < n; j += 4) {
    const float* kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = kbase + cells[std::min(j + i, n - 1)] * ks1;
    if (j + 4 + kAhead <= n)
      for (int i = 0; i < 4; ++i) __builtin_prefetch(kbase + cells[j + kAhead + i] * ks1);
    const int64_t valid = std::min<int64_t>(4, n - j);
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
  for (int64_t g = 0; g < group; ++g) softmax_f32(scores + g * n, qlens ? qlens[g] : n);
  constexpr int64_t kMaxVec = 32;  // hd <= 256
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * n;
    __m256 acc[kMaxVec];
    const int64_t nv = hd / 8, m = qlens ? qlens[g] : n;
    for (int64_t d = 0; d < nv; ++d) acc[d] = _mm256_setzero_ps();
    for (int64_t r = 0; r < m; ++r) {
      const float* vr = vbase + cells[r] * vs1;
      if (g == 0 && r + kAhead < m) __builtin_prefetch(vbase + cells[r + kAhead] * vs1);
      const __m256 pr = _mm256_set1_ps(p[r]);
      for (int64_t d = 0; d < nv; ++d) acc[d] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr + 8 * d), acc[d]);
    }
    for (int64_t d = 0; d < nv; ++d) _mm256_storeu_ps(out[g] + 8 * d, acc[d]);
  }
}
#endif

constexpr int kMaxQueries = 16;  // query vectors per task: a kv head's query heads x rows
constexpr int kMaxChunks = 8;    // head_dim / 32 (head_dim <= 256)

#ifdef CELLSERVE_AVX512_BF16
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

inline void prefetch_row(const at::BFloat16* row, int64_t hd) {  // every 64-byte line of a row
  for (int64_t b = 0; b < hd; b += 32) __builtin_prefetch(row + b);
}

// One task: nq bfloat16 query vectors that share one kv head, over the K/V rows of cells
// sc[0, n), head_dim % 32 == 0; query g sees the first qlens[g] of them (qlens null: all n).
// Scores by vdpbf16ps over blocks of 16 rows (bf16 pairs, float32 sums; q is bf16 already),
// softmax in float32, then P V by vdpbf16ps over row pairs with float32 sums. Rows are
// prefetched ahead (both 64-byte lines): a sequence's decode cells are scattered between other
// sequences'. scores: room for nq * (n + 1) floats.
void attend_bf16(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens, int64_t hd,
                 const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t kstride,
                 int64_t vstride, const int64_t* sc, int64_t n, float scale, float* scores,
                 at::BFloat16* const* dst) {
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
      rows[r] = kbase + sc[j + std::min<int64_t>(r, valid - 1)] * kstride;
      if (j + 16 + r < n) prefetch_row(kbase + sc[j + 16 + r] * kstride, hd);
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
    prefetch_row(vbase + sc[i] * vstride, hd);
  for (int64_t g = 0; g < nq; ++g) {
    // rows past qlens[g] and the last pair's pad row get weight 0 (no infinities: -ffast-math)
    float* sg = scores + g * ns;
    const int64_t m = qlens == nullptr ? n : qlens[g];
    softmax_inplace(sg, m);
    for (int64_t i = m; i < ns; ++i) sg[i] = 0.0f;
  }
  // P V by vdpbf16ps over row pairs: p rounds to bfloat16 as in the torch path (probs.to(v));
  // unpacklo/hi_epi16 interleave two rows, so lane k of acc[g][c][h] is dim 8 * (k / 4) + k % 4
  // (+ 4 for h = 1) of chunk c; fixed below.
  __m512 acc[kMaxQueries][kMaxChunks][2];
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if (i + kPairsAhead < n) prefetch_row(vbase + sc[i + kPairsAhead] * vstride, hd);
    if (i + kPairsAhead + 1 < n) prefetch_row(vbase + sc[i + kPairsAhead + 1] * vstride, hd);
    const at::BFloat16* r0 = vbase + sc[i] * vstride;
    const at::BFloat16* r1 = i + 1 < n ? vbase + sc[i + 1] * vstride : r0;
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
#endif

// every lens[i] in [1, n_cells]: the kernels read cells[.., :lens[i]] and divide by the sum
void check_lens(const at::Tensor& lens, int64_t n_cells) {
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= n_cells, "lens[", i, "] = ", lp[i], " is not in [1, ",
                n_cells, "]");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
         const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n_seq = q.size(0), n_heads = q.size(1), hd = q.size(2);
  const int64_t n_kv = k.size(0), group = n_heads / n_kv, max_kv = cells.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  // one task per (sequence, kv head): its `group` query heads share every K/V row read
  at::parallel_for(0, n_seq * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * hd), acc(group * hd), row(hd), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / n_kv, kvh = task % n_kv, n = lp[s];
      const int64_t* sc = cp + s * max_kv;
#ifdef CELLSERVE_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (hd % 32 == 0 && hd <= 32 * kMaxChunks && group <= kMaxQueries) {
          const T* qrows[kMaxQueries];
          T* dst[kMaxQueries];
          for (int64_t g = 0; g < group; ++g) {
            qrows[g] = qp + s * qs0 + (kvh * group + g) * qs1;
            dst[g] = op + s * os0 + (kvh * group + g) * os1;
          }
          if (task + 1 < end) {  // the next task's first K rows arrive while this one runs
            const int64_t s1 = (task + 1) / n_kv, kvh1 = (task + 1) % n_kv;
            const int64_t* sc1 = cp + s1 * max_kv;
            for (int64_t r = 0; r < std::min<int64_t>(lp[s1], 16); ++r)
              prefetch_row(kp + kvh1 * ks0 + sc1[r] * ks1, hd);
          }
          scores.resize(group * (n + 1));
          attend_bf16(qrows, group, nullptr, hd, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, sc, n, fscale,
                      scores.data(), dst);
          continue;
        }
      }
#endif
#ifdef CELLSERVE_F32_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (hd % 8 == 0 && hd <= 256 && group <= kMaxQueries) {
          float* dst[kMaxQueries];
          for (int64_t g = 0; g < group; ++g) {
            const float* src = qp + s * qs0 + (kvh * group + g) * qs1;
            for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = src[d] * fscale;
            dst[g] = op + s * os0 + (kvh * group + g) * os1;
          }
          scores.resize(group * n);
          attend_f32(qf.data(), group, nullptr, hd, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, sc,
                     n, scores.data(), dst);
          continue;
        }
      }
#endif
      scores.assign(group * n, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        load_row(qp + s * qs0 + (kvh * group + g) * qs1, qf.data() + g * hd, hd);
        for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] *= fscale;
      }
      for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) __builtin_prefetch(kp + kvh * ks0 + sc[j + kAhead] * ks1);
        load_row(kp + kvh * ks0 + sc[j] * ks1, row.data(), hd);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * hd;
          float dot = 0.0f;
          for (int64_t d = 0; d < hd; ++d) dot += qg[d] * row[d];
          scores[g * n + j] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + g * n, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) __builtin_prefetch(vp + kvh * vs0 + sc[j + kAhead] * vs1);
        load_row(vp + kvh * vs0 + sc[j] * vs1, row.data(), hd);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* ag = acc.data() + g * hd;
          for (int64_t d = 0; d < hd; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + s * os0 + (kvh * group + g) * os1;
        for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(acc[g * hd + d]);
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "the last dim must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(0) == 0, "n_heads must be a multiple of n_kv_heads");
  TORCH_CHECK(q.size(2) == k.size(2) && k.sizes() == v.sizes(), "head_dim / K-V shapes differ");
  TORCH_CHECK(cells.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "cells and lens must be int64");
  TORCH_CHECK(cells.dim() == 2 && cells.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "cells [n_seq, max_kv] and lens [n_seq] must match q");
  auto c = cells.contiguous();
  auto l = lens.contiguous();
  check_lens(l, c.size(1));
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, c, l, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k, v, c, l, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

// prompt_attention: one prompt chunk's attention, K/V read from the cells in place.
// q: [L, n_heads, head_dim]; k, v: as for decode_attention; cells: [n_kv] int64, the cells the
// chunk reads in position order; lens: [L] int64, how many of them row i sees (>= 1: a causal
// mask is a prefix of the position-ordered cells). head_dim % 32 == 0; bfloat16 on a CPU with
// AVX-512 BF16 (has_bf16_kernels()), float32 with AVX2 (has_f32_kernels()). A task is one kv
// head and a block of rows (its query heads x rows <= kMaxQueries share every K/V row read),
// scheduled dynamically: later rows see more. SmolLM2's 256-token prompt, bfloat16: 0.78 vs
// ~1.3 ms a layer for SDPA's flash kernel with the mask.
bool has_bf16_kernels() {
#ifdef CELLSERVE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  (f32 || q.scalar_type() == at::kBFloat16),
              "prompt_attention takes bfloat16 or float32 q, k, v of one dtype");
  TORCH_CHECK(f32 ? has_f32_kernels() : has_bf16_kernels(),
              f32 ? "prompt_attention on float32 needs AVX2 (the avx2 build or above)"
                  : "prompt_attention needs a CPU with AVX-512 BF16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "the last dim must be contiguous");
  const int64_t L = q.size(0), n_heads = q.size(1), hd = q.size(2), n_kv = k.size(0);
  TORCH_CHECK(n_heads % n_kv == 0, "n_heads must be a multiple of n_kv_heads");
  const int64_t group = n_heads / n_kv;
  TORCH_CHECK(hd % 32 == 0 && hd <= 32 * kMaxChunks && group <= kMaxQueries,
              "prompt_attention: head_dim must be a multiple of 32 up to 256, and at most 16 "
              "query heads per kv head");
  TORCH_CHECK(q.size(2) == k.size(2) && k.sizes() == v.sizes(), "head_dim / K-V shapes differ");
  TORCH_CHECK(cells.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "cells and lens must be int64");
  TORCH_CHECK(cells.dim() == 1 && lens.dim() == 1 && lens.size(0) == L,
              "cells [n_kv] and lens [L] must match q");
  auto c = cells.contiguous();
  auto l = lens.contiguous();
  check_lens(l, c.size(0));
  auto out = at::empty({L, n_heads, hd}, q.options());
  const int64_t rows = std::max<int64_t>(1, kMaxQueries / group);
  const int64_t n_blocks = (L + rows - 1) / rows, n_tasks = n_kv * n_blocks;
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t* lp = l.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const float fscale = static_cast<float>(scale);
  // A task is one kv head and a block of rows: its query heads x rows (<= kMaxQueries) share
  // every K/V row read. Scheduled dynamically, the longest rows first.
#ifdef CELLSERVE_F32_AVX2
  if (f32) {
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
#pragma omp parallel  // torch.set_num_threads set this thread's team size
    {
      std::vector<float> scores, qf(kMaxQueries * hd);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = n_tasks - 1; task >= 0; --task) {
        const int64_t kvh = task % n_kv, r0 = (task / n_kv) * rows;
        const int64_t r1 = std::min(L, r0 + rows);
        float* dst[kMaxQueries];
        int64_t qlens[kMaxQueries];
        int64_t nq = 0, n = 0;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = 0; g < group; ++g, ++nq) {
            const float* src = qp + r * qs0 + (kvh * group + g) * qs1;
            for (int64_t d = 0; d < hd; ++d) qf[nq * hd + d] = src[d] * fscale;
            dst[nq] = op + r * os0 + (kvh * group + g) * os1;
            qlens[nq] = lp[r];
            n = std::max(n, qlens[nq]);
          }
        scores.resize(nq * n);
        attend_f32(qf.data(), nq, qlens, hd, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, cp, n,
                   scores.data(), dst);
      }
    }
    return out;
  }
#endif
#ifdef CELLSERVE_AVX512_BF16
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vp = v.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
#pragma omp parallel  // torch.set_num_threads set this thread's team size
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = n_tasks - 1; task >= 0; --task) {  // the longest rows first
      const int64_t kvh = task % n_kv, r0 = (task / n_kv) * rows;
      const int64_t r1 = std::min(L, r0 + rows);
      const at::BFloat16* qrows[kMaxQueries];
      at::BFloat16* dst[kMaxQueries];
      int64_t qlens[kMaxQueries];
      int64_t nq = 0, n = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < group; ++g, ++nq) {
          qrows[nq] = qp + r * qs0 + (kvh * group + g) * qs1;
          dst[nq] = op + r * os0 + (kvh * group + g) * os1;
          qlens[nq] = lp[r];
          n = std::max(n, qlens[nq]);
        }
      scores.resize(nq * (n + 1));
      attend_bf16(qrows, nq, qlens, hd, kp + kvh * ks0, vp + kvh * vs0, ks1, vs1, cp, n, fscale,
                  scores.data(), dst);
    }
  }
#endif
  return out;
}

// whether prompt_attention takes float32 (the AVX2 kernel: the avx2 build and above)
bool has_f32_kernels() {
#ifdef CELLSERVE_F32_AVX2
  return true;
#else
  return false;
#endif
}

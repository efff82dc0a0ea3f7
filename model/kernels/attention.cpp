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
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// every lens[i] in [1, n_cells]: the kernels read cells[.., :lens[i]] and divide by the sum
void check_lens(const at::Tensor& lens, int64_t n_cells) {
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= n_cells, "lens[", i, "] = ", lp[i], " is not in [1, ",
                n_cells, "]");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
         const at::Tensor& lens, double scale, double softcap, const float* sinks,
         at::Tensor& out) {
  const int64_t n_seq = q.size(0), n_heads = q.size(1), hd = q.size(2);
  const int64_t n_kv = k.size(0), group = n_heads / n_kv, max_kv = cells.size(1);
  // cells of another type than q's (kvcache/cache_types.py): attend_bf16_coded and
  // attend_f32_coded decode each row as they read it; the generic loop dequantizes a task's
  // rows into its own buffers first
  constexpr CacheKind own = std::is_same_v<T, float> ? CacheKind::F32 : CacheKind::BF16;
  const CacheKind kk = cache_kind(k, hd), vk = cache_kind(v, hd);
  const bool convert = kk != own || vk != own;
  const T* qp = q.data_ptr<T>();
  const auto* kraw = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vraw = static_cast<const uint8_t*>(v.data_ptr());
  T* op = out.data_ptr<T>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t kb0 = k.stride(0) * k.element_size(), kb1 = k.stride(1) * k.element_size();
  const int64_t vb0 = v.stride(0) * v.element_size(), vb1 = v.stride(1) * v.element_size();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // one task per (sequence, kv head): its `group` query heads share every K/V row read
  at::parallel_for(0, n_seq * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * hd), acc(group * hd), row(hd), scores;
    std::vector<T> kbuf, vbuf;
    std::vector<int64_t> iota;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / n_kv, kvh = task % n_kv, n = lp[s];
      const int64_t* sc = cp + s * max_kv;
      const float* sk = sinks != nullptr ? sinks + kvh * group : nullptr;  // its query heads
      const T* kp = reinterpret_cast<const T*>(kraw + kvh * kb0);  // this head's rows
      const T* vp = reinterpret_cast<const T*>(vraw + kvh * vb0);
      int64_t ks1 = kb1 / static_cast<int64_t>(sizeof(T)), vs1 = vb1 / static_cast<int64_t>(sizeof(T));
#ifdef CELLSERVE_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (hd % 32 == 0 && hd <= 32 * kMaxChunks && group <= kMaxQueries) {
          const T* qrows[kMaxQueries];
          T* dst[kMaxQueries];
          for (int64_t g = 0; g < group; ++g) {
            qrows[g] = qp + s * qs0 + (kvh * group + g) * qs1;
            dst[g] = op + s * os0 + (kvh * group + g) * os1;
          }
          if (convert) {  // rows decoded as they are read
            scores.resize(group * (n + 1));
            attend_bf16_coded(qrows, group, nullptr, nullptr, hd, kk, kraw + kvh * kb0, kb1, vk,
                              vraw + kvh * vb0, vb1, sc, n, fscale, cap, sk, scores.data(), dst);
            continue;
          }
          if (task + 1 < end) {  // the next task's first K rows, during this one
            const int64_t s1 = (task + 1) / n_kv, kvh1 = (task + 1) % n_kv;
            const int64_t* sc1 = cp + s1 * max_kv;
            const auto* kp1 = reinterpret_cast<const T*>(kraw + kvh1 * kb0);
            for (int64_t r = 0; r < std::min<int64_t>(lp[s1], 16); ++r)
              prefetch_row(kp1 + sc1[r] * ks1, hd);
          }
          scores.resize(group * (n + 1));
          attend_bf16(qrows, group, nullptr, nullptr, hd, kp, vp, ks1, vs1, sc, n, fscale, cap, sk,
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
          if (convert)  // rows decoded as they are read
            attend_f32_coded(qf.data(), group, nullptr, nullptr, hd, kk, kraw + kvh * kb0, kb1, vk,
                             vraw + kvh * vb0, vb1, sc, n, cap, sk, scores.data(), dst);
          else
            attend_f32(qf.data(), group, nullptr, nullptr, hd, kp, vp, ks1, vs1, sc, n, cap, sk,
                       scores.data(), dst);
          continue;
        }
      }
#endif
      if (convert) {
        kbuf.resize(n * hd);
        vbuf.resize(n * hd);
        if (static_cast<int64_t>(iota.size()) < n) {
          iota.resize(n);
          for (int64_t i = 0; i < n; ++i) iota[i] = i;
        }
        for (int64_t j = 0; j < n; ++j) {
          if (j + kAhead < n) {
            __builtin_prefetch(kraw + kvh * kb0 + sc[j + kAhead] * kb1);
            __builtin_prefetch(vraw + kvh * vb0 + sc[j + kAhead] * vb1);
          }
          dequant_row(kk, kraw + kvh * kb0 + sc[j] * kb1, kbuf.data() + j * hd, hd);
          dequant_row(vk, vraw + kvh * vb0 + sc[j] * vb1, vbuf.data() + j * hd, hd);
        }
        kp = kbuf.data();
        vp = vbuf.data();
        ks1 = vs1 = hd;
        sc = iota.data();
      }
      scores.assign(group * n, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        load_row(qp + s * qs0 + (kvh * group + g) * qs1, qf.data() + g * hd, hd);
        for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] *= fscale;
      }
      for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) __builtin_prefetch(kp + sc[j + kAhead] * ks1);
        load_row(kp + sc[j] * ks1, row.data(), hd);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * hd;
          float dot = 0.0f;
          for (int64_t d = 0; d < hd; ++d) dot += qg[d] * row[d];
          scores[g * n + j] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        softcap_inplace(scores.data() + g * n, n, cap);
        softmax_inplace(scores.data() + g * n, n, sk != nullptr ? sk + g : nullptr);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) __builtin_prefetch(vp + sc[j + kAhead] * vs1);
        load_row(vp + sc[j] * vs1, row.data(), hd);
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

// sinks -> float32 [n_heads], contiguous (an undefined tensor for none)
at::Tensor sink_logits(const c10::optional<at::Tensor>& sinks, int64_t n_heads) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == n_heads, "sinks must be [n_heads]");
  return sinks->to(at::kFloat).contiguous();
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

}  // namespace

bool has_attention_sinks() { return true; }

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale,
                            double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "the last dim must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(0) == 0, "n_heads must be a multiple of n_kv_heads");
  cache_kind(k, q.size(2));  // K and V rows of a cache type for q's head_dim (else it throws)
  cache_kind(v, q.size(2));
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1), "K and V caches differ in shape");
  TORCH_CHECK(cells.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "cells and lens must be int64");
  TORCH_CHECK(cells.dim() == 2 && cells.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "cells [n_seq, max_kv] and lens [n_seq] must match q");
  auto c = cells.contiguous();
  auto l = lens.contiguous();
  check_lens(l, c.size(1));
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const at::Tensor sk = sink_logits(sinks, q.size(1));
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, c, l, scale, softcap, data_or_null(sk), out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k, v, c, l, scale, softcap, data_or_null(sk), out);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

// prompt_attention: one prompt chunk's attention, K/V read from the cells in place.
// q: [L, n_heads, head_dim]; k, v: as for decode_attention; cells: [n_kv] int64, the cells the
// chunk reads in position order; lens: [L] int64, how many of them row i sees (>= 1: a causal
// mask is a prefix of the position-ordered cells); firsts (a sliding window's chunk): [L]
// int64, the first of them row i sees (row i: cells[firsts[i], lens[i])). head_dim % 32 == 0;
// bfloat16 on a CPU with AVX-512 BF16 (has_bf16_kernels()), float32 with AVX2
// (has_f32_kernels()). A task is one kv head and a block of rows (its query heads x rows <= kMaxQueries share every K/V row read),
// scheduled dynamically: later rows see more. SmolLM2's 256-token prompt, bfloat16: 0.78 vs
// ~1.3 ms a layer for SDPA's flash kernel with the mask.

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale,
                            double softcap, const c10::optional<at::Tensor>& sinks,
                            const c10::optional<at::Tensor>& firsts) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
    // cells of another cache type: the chunk's cells dequantized once (not once per task),
    // in position order, then read in place
    TORCH_CHECK(cells.scalar_type() == at::kLong && cells.dim() == 1, "cells [n_kv] int64");
    auto c = cells.contiguous();
    auto kd = dequant_cells(k.contiguous(), c, q.size(2), q.scalar_type());
    auto vd = dequant_cells(v.contiguous(), c, q.size(2), q.scalar_type());
    auto order = at::arange(c.size(0), c.options());
    return prompt_attention(q, kd, vd, order, lens, scale, softcap, sinks, firsts);
  }
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
  at::Tensor f;  // a sliding window's rows: row i sees cells[firsts[i], lens[i])
  if (firsts.has_value() && firsts->defined() && firsts->numel() > 0) {
    f = firsts->contiguous();
    TORCH_CHECK(f.scalar_type() == at::kLong && f.dim() == 1 && f.size(0) == L,
                "firsts must be [L] int64");
    const int64_t* fp = f.data_ptr<int64_t>();
    const int64_t* lp = l.data_ptr<int64_t>();
    for (int64_t i = 0; i < L; ++i)
      TORCH_CHECK(fp[i] >= 0 && fp[i] < lp[i], "firsts[", i, "] = ", fp[i], " is not in [0, lens[",
                  i, "] = ", lp[i], ")");
  }
  auto out = at::empty({L, n_heads, hd}, q.options());
  const int64_t rows = std::max<int64_t>(1, kMaxQueries / group);
  const int64_t n_blocks = (L + rows - 1) / rows, n_tasks = n_kv * n_blocks;
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t* lp = l.data_ptr<int64_t>();
  const int64_t* fp = f.defined() ? f.data_ptr<int64_t>() : nullptr;
  // a task reads its rows' cells from the first any of them sees (rounded down to an even
  // index: the bfloat16 kernel sums V in pairs of rows from there, so the pairs stay the same
  // for any block of rows), each row's lens and firsts counted from there
  auto task_base = [fp](int64_t r0, int64_t r1) -> int64_t {
    if (fp == nullptr) return 0;
    int64_t base = fp[r0];
    for (int64_t r = r0 + 1; r < r1; ++r) base = std::min(base, fp[r]);
    return base & ~int64_t{1};
  };
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const at::Tensor sk = sink_logits(sinks, n_heads);
  const float* skp = data_or_null(sk);
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
        float qsinks[kMaxQueries];
        int64_t qlens[kMaxQueries], qfirsts[kMaxQueries];
        int64_t nq = 0, n = 0;
        const int64_t base = task_base(r0, r1);
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = 0; g < group; ++g, ++nq) {
            const float* src = qp + r * qs0 + (kvh * group + g) * qs1;
            for (int64_t d = 0; d < hd; ++d) qf[nq * hd + d] = src[d] * fscale;
            dst[nq] = op + r * os0 + (kvh * group + g) * os1;
            qsinks[nq] = skp != nullptr ? skp[kvh * group + g] : 0.0f;
            qlens[nq] = lp[r] - base;
            qfirsts[nq] = fp != nullptr ? fp[r] - base : 0;
            n = std::max(n, qlens[nq]);
          }
        scores.resize(nq * n);
        attend_f32(qf.data(), nq, qlens, fp != nullptr ? qfirsts : nullptr, hd, kp + kvh * ks0,
                   vp + kvh * vs0, ks1, vs1, cp + base, n, cap,
                   skp != nullptr ? qsinks : nullptr, scores.data(), dst);
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
      float qsinks[kMaxQueries];
      int64_t qlens[kMaxQueries], qfirsts[kMaxQueries];
      int64_t nq = 0, n = 0;
      const int64_t base = task_base(r0, r1);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < group; ++g, ++nq) {
          qrows[nq] = qp + r * qs0 + (kvh * group + g) * qs1;
          dst[nq] = op + r * os0 + (kvh * group + g) * os1;
          qsinks[nq] = skp != nullptr ? skp[kvh * group + g] : 0.0f;
          qlens[nq] = lp[r] - base;
          qfirsts[nq] = fp != nullptr ? fp[r] - base : 0;
          n = std::max(n, qlens[nq]);
        }
      scores.resize(nq * (n + 1));
      attend_bf16(qrows, nq, qlens, fp != nullptr ? qfirsts : nullptr, hd, kp + kvh * ks0,
                  vp + kvh * vs0, ks1, vs1, cp + base, n, fscale, cap,
                  skp != nullptr ? qsinks : nullptr, scores.data(), dst);
    }
  }
#endif
  return out;
}

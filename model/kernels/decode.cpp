// CPU decode kernels over the cell cache (built by model/kernels/__init__.py).
//
// decode_attention: attention reading K/V from the cells in place (no gather).
//
// q:     [n_seq, n_heads, head_dim]            float32 or bfloat16 (the cache's dtype)
// k, v:  [n_kv_heads, n_cells, head_dim]       one layer of KVStorage (head-major), any
//                                              strides with a contiguous last dim
// cells: [n_seq, max_kv] int64                 the cells sequence s attends, padded
// lens:  [n_seq] int64                         how many of cells[s] it attends (>= 1)
// -> [n_seq, n_heads, head_dim] in q's dtype; query head h reads kv head h / (n_heads / n_kv_heads)
// (GQA as in HF's repeat_kv). Scores, softmax and the weighted sum are float32.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kAhead = 8;  // rows prefetched ahead: cells are scattered, not streamed

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
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
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        const float mx = *std::max_element(sg, sg + n);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
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

// decode_layers: every layer of a Llama decode step of up to 8 sequences in one call, int4 weights
// (model/quant.py QuantLinear "int4", no bias), bfloat16, rotate-half RoPE over the whole head:
// the same ATen ops, in the same order, as model/llama.py's Block, without the Python between
// them. weights: per layer, in order: attn_norm, wqkv packed, wqkv scales, wo packed, wo scales,
// ffn_norm, w13 packed, w13 scales, w2 packed, w2 scales. k_cache, v_cache: KVStorage.k / .v
// ([n_layers, n_kv_heads, n_cells, head_dim]); write_cells [n]: where each row's K/V goes;
// rope_c, rope_s: [n, 1, head_dim] (kvcache.storage.rope_tables); kv_cells, lens: as for
// decode_attention, row i being sequence i. Returns the hidden state after the last layer.
at::Tensor decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& write_cells, const at::Tensor& rope_c,
                         const at::Tensor& rope_s, const at::Tensor& kv_cells,
                         const at::Tensor& lens, int64_t n_heads, double eps, double scale,
                         int64_t group_size) {
  constexpr int64_t kPerLayer = 10;
  const int64_t n_layers = k_cache.size(0), n_kv = k_cache.size(1), hd = k_cache.size(3);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kPerLayer,
              "decode_layers: expected ", n_layers * kPerLayer, " weight tensors");
  const int64_t n = x.size(0), d = x.size(1), half = hd / 2, qk_width = (n_heads + n_kv) * hd;
  auto mm = [group_size](const at::Tensor& a, const at::Tensor& packed, const at::Tensor& sz) {
    return at::_weight_int4pack_mm_for_cpu(a, packed, group_size, sz);
  };
  for (int64_t l = 0; l < n_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    auto qkv = mm(at::rms_norm(x, {d}, w[0], eps), w[1], w[2]);
    auto qk = qkv.narrow(1, 0, qk_width).view({n, n_heads + n_kv, hd});
    auto partner = at::cat({qk.narrow(2, half, hd - half), qk.narrow(2, 0, half)}, 2);
    qk = at::addcmul(qk * rope_c, partner, rope_s);
    auto v = qkv.narrow(1, qk_width, n_kv * hd).view({n, n_kv, hd});
    auto k_layer = k_cache.select(0, l);
    auto v_layer = v_cache.select(0, l);
    k_layer.index_copy_(1, write_cells, qk.narrow(1, n_heads, n_kv).transpose(0, 1));
    v_layer.index_copy_(1, write_cells, v.transpose(0, 1));
    auto attn = decode_attention(qk.narrow(1, 0, n_heads), k_layer, v_layer, kv_cells, lens, scale);
    x = x + mm(attn.view({n, n_heads * hd}), w[3], w[4]);
    auto gate_up = mm(at::rms_norm(x, {d}, w[5], eps), w[6], w[7]);
    const int64_t f = gate_up.size(1) / 2;
    x = x + mm(at::silu(gate_up.narrow(1, 0, f)) * gate_up.narrow(1, f, f), w[8], w[9]);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over cells, in place");
  m.def("decode_layers", &decode_layers, "every layer of an int4 decode step");
}

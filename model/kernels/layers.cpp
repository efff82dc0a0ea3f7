// CPU kernels for the rest of a layer and the one-call decode step (built by
// model/kernels/__init__.py, with attention.cpp, into one extension; the Python bindings).
#include "kernels.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

// rms_norm_bf16 / silu_mul_bf16: what model/llama.py's RMSNorm and FeedForward compute for
// bfloat16 rows, rounded to bfloat16 where torch rounds, in one pass each instead of ~10 ATen
// ops (RMSNorm of [32, 576]: 4.3 vs 24.7 us). The float32 math inside differs from torch's in
// op order (-ffast-math, vector expf), so a value can differ by one bfloat16 step, rarely. Both
// paths call these, so the one-call decode step stays bit-identical to the Python layers.
//
// x [n, d] -> bf16(x * rsqrt(mean(x^2) + eps) * w) in float32, rounded once as torch 2.13.
// Into `out` (x's shape, contiguous): decode_layers reuses one buffer across layers; NOINLINE,
// so that both paths run the same machine code (-ffast-math sums vectorize per call site).
__attribute__((noinline)) void rms_norm_bf16_into(const at::Tensor& x_in, const at::Tensor& w_in,
                                                  double eps, at::Tensor& out) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_in.scalar_type() == at::kBFloat16,
              "rms_norm_bf16 takes bfloat16");
  const int64_t d = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == d, "rms_norm_bf16: weight size differs from the last dim");
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm_bf16: out must be contiguous, of x's shape and dtype");
  const int64_t n = x.numel() / d;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* xr = xp + r * d;
      at::BFloat16* orow = op + r * d;
      float ss = 0.0f;
      for (int64_t i = 0; i < d; ++i) {
        const float v = to_float(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + feps);
      for (int64_t i = 0; i < d; ++i) orow[i] = at::BFloat16(to_float(xr[i]) * inv * to_float(wp[i]));
    }
  });
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto out = at::empty(x.sizes(), x.options());
  rms_norm_bf16_into(x, w, eps, out);
  return out;
}

// gate_up [n, 2f] (gate then up) -> [n, f]: bf16(bf16(silu(gate)) * up).
__attribute__((noinline)) void silu_mul_bf16_into(const at::Tensor& gate_up_in, at::Tensor& out) {
  TORCH_CHECK(gate_up_in.scalar_type() == at::kBFloat16 && gate_up_in.dim() == 2 &&
                  gate_up_in.size(1) % 2 == 0,
              "silu_mul_bf16 takes [n, 2f] bfloat16");
  auto gu = gate_up_in.contiguous();
  const int64_t n = gu.size(0), f = gu.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == f &&
                  out.scalar_type() == gu.scalar_type(),
              "silu_mul_bf16: out must be contiguous [n, f] of gate_up's dtype");
  const auto* gp = gu.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / f), [&](int64_t begin, int64_t end) {
    std::vector<float> g(f);
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gr = gp + r * 2 * f;
      for (int64_t i = 0; i < f; ++i) {
        const float v = to_float(gr[i]);
        g[i] = v / (1.0f + std::exp(-v));
      }
      at::BFloat16* orow = op + r * f;
      for (int64_t i = 0; i < f; ++i)
        orow[i] = at::BFloat16(to_float(at::BFloat16(g[i])) * to_float(gr[f + i]));
    }
  });
}

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_bf16_into(gate_up, out);
  return out;
}

// rope_neox_: rotate-half ("neox") RoPE over the whole head, in place, in one pass instead of
// model/llama.py's cat + mul + addcmul (3 ATen ops, 2 allocations). x [n, heads, hd] (any row
// and head strides, dims contiguous), c, s [n, 1, hd] (kvcache.storage.rope_tables) in x's
// dtype: x[i] = x[i] * c[i] + partner[i] * s[i], partner = (x[hd/2:], x[:hd/2]).
// NOTE: bfloat16 rounds where torch's `addcmul(qk * c, partner, s)` rounds: the mul to
// bfloat16, then the add in float32 to bfloat16 (a product of two bfloat16 values is exact
// in float32, so with or without FMA the bits are torch's). float32: fma(p, s, x * c) with
// x * c rounded, as torch's mul then addcmul (whose CPU kernel fuses; fp-contract=off keeps
// the compiler from fusing the other product: a third of the values differed); both paths
// call this kernel (NOINLINE).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(T* xp, int64_t n, int64_t heads, int64_t hd, int64_t xs0, int64_t xs1,
               const T* cp, const T* sp) {
  const int64_t half = hd / 2;
  auto rotate = [&](int64_t r) {
    const T* c = cp + r * hd;
    const T* s = sp + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = xp + r * xs0 + h * xs1;
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(x[i]), b = to_float(x[i + half]);
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          const float ac = to_float(at::BFloat16(a * to_float(c[i])));
          const float bc = to_float(at::BFloat16(b * to_float(c[i + half])));
          x[i] = at::BFloat16(ac + b * to_float(s[i]));
          x[i + half] = at::BFloat16(bc + a * to_float(s[i + half]));
        } else {
          x[i] = std::fma(b, s[i], a * c[i]);
          x[i + half] = std::fma(a, s[i + half], b * c[i + half]);
        }
      }
    }
  };
  if (n * heads * hd < 32768) {  // a decode step's rows: a thread pool hand-off costs more
    for (int64_t r = 0; r < n; ++r) rotate(r);
    return;
  }
  at::parallel_for(0, n, std::max<int64_t>(1, 8192 / (heads * hd)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rotate(r);
  });
}

__attribute__((noinline)) at::Tensor rope_neox_(at::Tensor x, const at::Tensor& c_in,
                                                const at::Tensor& s_in) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_neox_ takes x [n, heads, head_dim] with contiguous, even head_dim");
  TORCH_CHECK(c_in.scalar_type() == x.scalar_type() && s_in.scalar_type() == x.scalar_type(),
              "rope_neox_: c and s must be in x's dtype");
  const int64_t n = x.size(0), heads = x.size(1), hd = x.size(2);
  TORCH_CHECK(c_in.numel() == n * hd && s_in.numel() == n * hd && c_in.size(0) == n &&
                  c_in.size(-1) == hd && s_in.sizes() == c_in.sizes(),
              "rope_neox_: c and s must be [n, 1, head_dim] for x [n, heads, head_dim]");
  auto c = c_in.contiguous();
  auto s = s_in.contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    rope_rows(x.data_ptr<at::BFloat16>(), n, heads, hd, x.stride(0), x.stride(1),
              c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rope_neox_ takes bfloat16 or float32");
    rope_rows(x.data_ptr<float>(), n, heads, hd, x.stride(0), x.stride(1), c.data_ptr<float>(),
              s.data_ptr<float>());
  }
  return x;
}

// add_rows_: x += y for contiguous x, y of one dtype: torch's x + y bit for bit (bfloat16: the
// sum in float32, rounded once), without an allocation or a dispatch.
void add_rows_(at::Tensor& x, const at::Tensor& y) {
  const int64_t numel = x.numel();
  if (x.scalar_type() == at::kBFloat16) {
    auto* xp = x.data_ptr<at::BFloat16>();
    const auto* yp = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < numel; ++i) xp[i] = at::BFloat16(to_float(xp[i]) + to_float(yp[i]));
  } else {
    float* xp = x.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < numel; ++i) xp[i] += yp[i];
  }
}

// write_kv: the step's K and V rows [n, n_kv, hd] (row stride src_s0, head stride hd) into
// cells[r] of one layer's cache [n_kv, n_cells, hd] (contiguous), as raw row copies: what
// KVStorage.write's two index_copy_ calls store. The caller checked every cell is in range.
void write_kv(const at::Tensor& k_layer, const at::Tensor& v_layer, const int64_t* cells,
              const char* k_src, const char* v_src, int64_t n, int64_t n_kv, int64_t hd,
              int64_t src_s0, int64_t elem) {
  char* kp = static_cast<char*>(k_layer.data_ptr());
  char* vp = static_cast<char*>(v_layer.data_ptr());
  const int64_t n_cells = k_layer.size(1), row = hd * elem;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < n_kv; ++h) {
      const int64_t dst = (h * n_cells + cells[r]) * row, src = (r * src_s0 + h * hd) * elem;
      std::memcpy(kp + dst, k_src + src, row);
      std::memcpy(vp + dst, v_src + src, row);
    }
  }
}

// oneDNN's bfloat16 linear over a weight prepacked by mkldnn::_reorder_linear_weight (what
// model/quant.py dense_linear runs), through the dispatcher: it has no at:: function.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// rms_norm_f32 / silu_mul_f32: the float32 twins (no rounding; -ffast-math sums, so a value
// can differ from F.rms_norm's in the last bits). RMSNorm of [1, 576] as ~6 ATen ops cost ~24 us.
// Into `out` (x's shape, contiguous): decode_layers reuses one buffer across layers; NOINLINE,
// so that both paths run the same machine code (-ffast-math sums vectorize per call site).
__attribute__((noinline)) void rms_norm_f32_into(const at::Tensor& x_in, const at::Tensor& w_in,
                                                 double eps, at::Tensor& out) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat,
              "rms_norm_f32 takes float32");
  const int64_t d = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == d, "rms_norm_f32: weight size differs from the last dim");
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm_f32: out must be contiguous, of x's shape and dtype");
  const int64_t n = x.numel() / d;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float ss = 0.0f;
      for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + feps);
      for (int64_t i = 0; i < d; ++i) op[r * d + i] = xr[i] * inv * wp[i];
    }
  });
}

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto out = at::empty(x.sizes(), x.options());
  rms_norm_f32_into(x, w, eps, out);
  return out;
}

__attribute__((noinline)) void silu_mul_f32_into(const at::Tensor& gate_up_in, at::Tensor& out) {
  TORCH_CHECK(gate_up_in.scalar_type() == at::kFloat && gate_up_in.dim() == 2 &&
                  gate_up_in.size(1) % 2 == 0,
              "silu_mul_f32 takes [n, 2f] float32");
  auto gu = gate_up_in.contiguous();
  const int64_t n = gu.size(0), f = gu.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == f &&
                  out.scalar_type() == gu.scalar_type(),
              "silu_mul_f32: out must be contiguous [n, f] of gate_up's dtype");
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / f), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = gp + r * 2 * f;
      for (int64_t i = 0; i < f; ++i) op[r * f + i] = gr[i] / (1.0f + std::exp(-gr[i])) * gr[f + i];
    }
  });
}

at::Tensor silu_mul_f32(const at::Tensor& gate_up) {
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_f32_into(gate_up, out);
  return out;
}

// The fused RMSNorm and SiLU-mul for the activation dtype: what model/blocks.py calls through
// ForwardBatch.fused, and decode_layers, so that both paths compute the same values.
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x.scalar_type() == at::kBFloat16 ? rms_norm_bf16(x, w, eps) : rms_norm_f32(x, w, eps);
}

at::Tensor silu_mul_of(const at::Tensor& gate_up) {
  return gate_up.scalar_type() == at::kBFloat16 ? silu_mul_bf16(gate_up) : silu_mul_f32(gate_up);
}

void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_bf16_into(x, w, eps, out);
  } else {
    rms_norm_f32_into(x, w, eps, out);
  }
}

void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_bf16_into(gate_up, out);
  } else {
    silu_mul_f32_into(gate_up, out);
  }
}

// model/quant.py QuantLinear.forward (int4 or int8, no bias) on a weight triple: up to
// small_rows rows the quantized kernel, more rows the batch one. int4 with float32 rows:
// (q4, q4_scale_min, q4_gemm), int4_mm then int4_gemm; int4 with bfloat16 rows: (torch's
// int4pack, scales_zeros, dense), _weight_int4pack_mm then the dense copy in its own dtype; int8:
// (int8, scales, dense), torch's _weight_int8pack_mm (bfloat16 rows only) then the dense copy.
at::Tensor quant_linear(const at::Tensor& a, const at::Tensor* w, int64_t group_size,
                        int64_t small_rows, bool packed, bool int8) {
  if (!int8 && a.scalar_type() == at::kFloat) {
    return a.size(0) <= small_rows ? int4_mm(a, w[0], w[1]) : int4_gemm(a, w[2], w[0].size(0));
  }
  if (a.size(0) <= small_rows) {
    if (int8) {
      if (a.scalar_type() == at::kBFloat16) return at::_weight_int8pack_mm(a, w[0], w[1]);
      return at::_weight_int8pack_mm(a.to(at::kBFloat16), w[0], w[1]).to(a.scalar_type());
    }
    return at::_weight_int4pack_mm_for_cpu(a, w[0], group_size, w[1]);
  }
  const auto dense = w[2].scalar_type();
  const at::Tensor in = a.scalar_type() == dense ? a : a.to(dense);
  auto y = packed ? packed_linear(in, w[2]) : at::linear(in, w[2]);
  return y.scalar_type() == a.scalar_type() ? y : y.to(a.scalar_type());
}

// decode_layers: every layer of a Llama decode step in one call, bfloat16 or float32
// activations, weights of model/quant.py QuantLinear "int4" or "int8" (no bias), rotate-half RoPE over
// the whole head: the same ops, in the same order, as model/llama.py's Block, without the
// Python between them, and without ATen calls where a raw pass gives the same bits: RoPE in
// place (rope_neox_, which the Python layers call too), K/V rows memcpy'd into their cells
// (KVStorage.write's index_copy_), residual adds into one stream (torch's x + y, rounded once),
// one RMSNorm and one SiLU-mul buffer for all layers. weights: per layer, in order: attn_norm, then wqkv as a triple for
// quant_linear, wo (3), ffn_norm, w13 (3), w2 (3); the triple is (torch int4pack, bfloat16
// scales_zeros, dense) for bfloat16 activations and (QuantLinear.q4, .q4_scale_min, .q4_gemm)
// for float32 ones; with `int8`, (int8 [n, k], bfloat16 scales [n], dense). The dense copy is prepacked for oneDNN where `packed` (oneDNN has no bfloat16
// prepacking below AVX-512: there the plain at::linear, as model/quant.py dense_linear does).
// k_cache, v_cache: KVStorage.k / .v ([n_layers, n_kv_heads, n_cells, head_dim], x's dtype);
// write_cells [n]: where each row's K/V goes; rope_c, rope_s: [n, 1, head_dim]
// (kvcache.storage.rope_tables); kv_cells, lens: as for decode_attention, row i being
// sequence i. Returns the hidden state after the last layer.
at::Tensor decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& write_cells, const at::Tensor& rope_c,
                         const at::Tensor& rope_s, const at::Tensor& kv_cells,
                         const at::Tensor& lens, int64_t n_heads, double eps, double scale,
                         int64_t group_size, int64_t small_rows, bool packed, bool int8) {
  constexpr int64_t kPerLayer = 14;
  const int64_t n_layers = k_cache.size(0), n_kv = k_cache.size(1), hd = k_cache.size(3);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kPerLayer,
              "decode_layers: expected ", n_layers * kPerLayer, " weight tensors");
  TORCH_CHECK(x.scalar_type() == k_cache.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "decode_layers: x and the cache must both be bfloat16 or float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "decode_layers: k_cache and v_cache must be contiguous and of one shape");
  const int64_t n = x.size(0), qk_width = (n_heads + n_kv) * hd, width = qk_width + n_kv * hd;
  const int64_t n_cells = k_cache.size(2);
  auto cells = write_cells.to(at::kLong).contiguous();
  TORCH_CHECK(cells.numel() == n, "decode_layers: write_cells must have one cell per row");
  const int64_t* cp = cells.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(cp[r] >= 0 && cp[r] < n_cells, "decode_layers: write_cells[", r, "] = ", cp[r],
                " is not in [0, ", n_cells, ")");
  auto mm = [group_size, small_rows, packed, int8](const at::Tensor& a, const at::Tensor* w) {
    return quant_linear(a, w, group_size, small_rows, packed, int8);
  };
  x = x.contiguous().clone();  // NOTE: the residual stream, updated in place layer by layer
  const int64_t elem = static_cast<int64_t>(x.element_size());
  auto normed = at::empty_like(x);  // each RMSNorm's output, reused across layers
  at::Tensor gated;                  // [n, ffn]: each SiLU-mul's output, reused
  for (int64_t l = 0; l < n_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    rms_norm_into(x, w[0], eps, normed);
    auto qkv = mm(normed, w + 1).contiguous();  // [n, width]
    TORCH_CHECK(qkv.size(1) == width, "decode_layers: wqkv gives ", qkv.size(1), " columns, not ",
                width);
    auto qk = qkv.as_strided({n, n_heads + n_kv, hd}, {width, hd, 1});
    rope_neox_(qk, rope_c, rope_s);
    auto k_layer = k_cache.select(0, l);
    auto v_layer = v_cache.select(0, l);
    const char* base = static_cast<const char*>(qkv.data_ptr());
    write_kv(k_layer, v_layer, cp, base + n_heads * hd * elem, base + qk_width * elem, n, n_kv,
             hd, width, elem);
    auto q = qkv.as_strided({n, n_heads, hd}, {width, hd, 1});
    auto attn = decode_attention(q, k_layer, v_layer, kv_cells, lens, scale);
    add_rows_(x, mm(attn.view({n, n_heads * hd}), w + 4).contiguous());
    rms_norm_into(x, w[7], eps, normed);
    auto gate_up = mm(normed, w + 8);
    if (!gated.defined()) gated = at::empty({n, gate_up.size(1) / 2}, x.options());
    silu_mul_into(gate_up, gated);
    add_rows_(x, mm(gated, w + 11).contiguous());
  }
  return x;
}

// What the compiler targeted (the build's -march): checked against model/kernels/isa.py's level
// by tests/model/test_kernels.py, so that a level's build never uses more than its CPUs have.
std::string compiled_isa() {
  std::string out;
#if defined(__AVX2__)
  out += "avx2 ";
#endif
#if defined(__FMA__)
  out += "fma ";
#endif
#if defined(__AVX512F__)
  out += "avx512f ";
#endif
#if defined(__AVX512BW__)
  out += "avx512bw ";
#endif
#if defined(__AVX512VL__)
  out += "avx512vl ";
#endif
#if defined(__AVX512VNNI__)
  out += "avx512_vnni ";
#endif
#if defined(__AVX512BF16__)
  out += "avx512_bf16 ";
#endif
#if defined(__AMX_TILE__)
  out += "amx_tile ";
#endif
#if defined(__ARM_NEON)
  out += "neon ";
#endif
  if (!out.empty()) out.pop_back();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over cells, in place");
  m.def("prompt_attention", &prompt_attention, "a prompt chunk's attention over cells, bf16");
  m.def("has_bf16_kernels", &has_bf16_kernels, "whether the AVX-512 BF16 kernels are built");
  m.def("has_f32_kernels", &has_f32_kernels, "whether prompt_attention takes float32 (AVX2)");
  m.def("compiled_isa", &compiled_isa, "the instruction-set extensions this build was compiled for");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bfloat16 rows, rounded as torch rounds");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up of bfloat16 rows");
  m.def("rms_norm_f32", &rms_norm_f32, "RMSNorm of float32 rows in one pass");
  m.def("silu_mul_f32", &silu_mul_f32, "silu(gate) * up of float32 rows");
  m.def("rms_norm", &rms_norm_of, "RMSNorm of bfloat16 or float32 rows, in one pass");
  m.def("silu_mul", &silu_mul_of, "silu(gate) * up of bfloat16 or float32 rows, in one pass");
  m.def("rope_neox_", &rope_neox_, "rotate-half RoPE of [n, heads, head_dim] in place");
  m.def("int4_mm", &int4_mm, "float32 rows times cellserve-layout int4 weights, in int8");
  m.def("int4_gemm", &int4_gemm, "float32 batches times int4 weights (pack_int4_gemm), in int8");
  m.def("int8_mm", &int8_mm, "float32 rows times int8 weights with a scale per 32, in int8");
  m.def("decode_layers", &decode_layers, "every layer of an int4 / int8 decode step, bf16 or f32");
}

// The one-call step (model/native.py): a Llama block's computation over all layers in C++,
// with the kernels the Python layers call (layers.cpp, attention*.cpp, int4.cpp, gemm.cpp).
#include "kernels.h"

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

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

using Attend = c10::function_ref<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

// every layer over x with `attend(q [n, heads, hd] strided, k_layer, v_layer) -> [n, heads, hd]`
at::Tensor run_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                      const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& write_cells, const at::Tensor& rope_c,
                      const at::Tensor& rope_s, int64_t n_heads, double eps, int64_t group_size,
                      int64_t small_rows, bool packed, bool int8, Attend attend) {
  constexpr int64_t kPerLayer = 14;
  const int64_t n_layers = k_cache.size(0), n_kv = k_cache.size(1), hd = k_cache.size(3);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * kPerLayer,
              "step_layers: expected ", n_layers * kPerLayer, " weight tensors");
  TORCH_CHECK(x.scalar_type() == k_cache.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "step_layers: x and the cache must both be bfloat16 or float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "step_layers: k_cache and v_cache must be contiguous and of one shape");
  const int64_t n = x.size(0), qk_width = (n_heads + n_kv) * hd, width = qk_width + n_kv * hd;
  const int64_t n_cells = k_cache.size(2);
  auto cells = write_cells.to(at::kLong).contiguous();
  TORCH_CHECK(cells.numel() == n, "step_layers: write_cells must have one cell per row");
  const int64_t* cp = cells.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(cp[r] >= 0 && cp[r] < n_cells, "step_layers: write_cells[", r, "] = ", cp[r],
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
    TORCH_CHECK(qkv.size(1) == width, "step_layers: wqkv gives ", qkv.size(1), " columns, not ",
                width);
    auto qk = qkv.as_strided({n, n_heads + n_kv, hd}, {width, hd, 1});
    rope_neox_(qk, rope_c, rope_s);
    auto k_layer = k_cache.select(0, l);
    auto v_layer = v_cache.select(0, l);
    const char* base = static_cast<const char*>(qkv.data_ptr());
    write_kv(k_layer, v_layer, cp, base + n_heads * hd * elem, base + qk_width * elem, n, n_kv,
             hd, width, elem);
    auto q = qkv.as_strided({n, n_heads, hd}, {width, hd, 1});
    auto attn = attend(q, k_layer, v_layer);
    add_rows_(x, mm(attn.view({n, n_heads * hd}), w + 4).contiguous());
    rms_norm_into(x, w[7], eps, normed);
    auto gate_up = mm(normed, w + 8);
    if (!gated.defined()) gated = at::empty({n, gate_up.size(1) / 2}, x.options());
    silu_mul_into(gate_up, gated);
    add_rows_(x, mm(gated, w + 11).contiguous());
  }
  return x;
}

}  // namespace

// step_layers: every layer of a Llama step in one call (decode rows, prompt chunks or both),
// bfloat16 or float32 activations, weights of model/quant.py QuantLinear "int4" or "int8" (no bias), rotate-half RoPE over
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
// (kvcache.storage.rope_tables). The attention groups of model/batch.py, each kernel-ready
// (cells and lens set): per decode group its rows (an empty tensor: every row of the batch, in
// order), cells [n_seq, max_kv] and lens [n_seq] for decode_attention; per prompt chunk its rows
// [start, end) (prompt_bounds: start, end, ...), cells [n_kv] in position order and lens
// [end - start] for prompt_attention. Each layer's attention output is assembled as
// model/llama.py's Attention.forward does (index_copy_ of each decode group, a slice copy of
// each chunk; rows in no group are zero). Returns the hidden state after the last layer.
at::Tensor step_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& write_cells, const at::Tensor& rope_c,
                       const at::Tensor& rope_s, const std::vector<at::Tensor>& decode_rows,
                       const std::vector<at::Tensor>& decode_cells,
                       const std::vector<at::Tensor>& decode_lens,
                       const std::vector<int64_t>& prompt_bounds,
                       const std::vector<at::Tensor>& prompt_cells,
                       const std::vector<at::Tensor>& prompt_lens, int64_t n_heads, double eps,
                       double scale, int64_t group_size, int64_t small_rows, bool packed,
                       bool int8) {
  const int64_t n = x.size(0), n_dec = static_cast<int64_t>(decode_rows.size());
  const int64_t n_prompt = static_cast<int64_t>(prompt_cells.size());
  TORCH_CHECK(static_cast<int64_t>(decode_cells.size()) == n_dec &&
                  static_cast<int64_t>(decode_lens.size()) == n_dec &&
                  static_cast<int64_t>(prompt_lens.size()) == n_prompt &&
                  static_cast<int64_t>(prompt_bounds.size()) == 2 * n_prompt,
              "step_layers: one rows / cells / lens per decode group, one bounds / cells / lens "
              "per prompt chunk");
  for (int64_t i = 0; i < n_prompt; ++i)
    TORCH_CHECK(0 <= prompt_bounds[2 * i] && prompt_bounds[2 * i] < prompt_bounds[2 * i + 1] &&
                    prompt_bounds[2 * i + 1] <= n,
                "step_layers: prompt chunk ", i, " is not a range of the batch's ", n, " rows");
  const bool one_group = n_dec == 1 && n_prompt == 0 && decode_rows[0].numel() == 0;
  auto attend = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    if (one_group) return decode_attention(q, k, v, decode_cells[0], decode_lens[0], scale);
    auto out = at::zeros({n, q.size(1), q.size(2)}, q.options());
    for (int64_t i = 0; i < n_dec; ++i) {
      const at::Tensor& rows = decode_rows[i];
      TORCH_CHECK(rows.numel() > 0, "step_layers: a group of every row must be the only group");
      out.index_copy_(0, rows,
                      decode_attention(q.index_select(0, rows), k, v, decode_cells[i],
                                       decode_lens[i], scale));
    }
    for (int64_t i = 0; i < n_prompt; ++i) {
      const int64_t start = prompt_bounds[2 * i], end = prompt_bounds[2 * i + 1];
      out.slice(0, start, end)
          .copy_(prompt_attention(q.slice(0, start, end), k, v, prompt_cells[i], prompt_lens[i],
                                  scale));
    }
    return out;
  };
  return run_layers(std::move(x), weights, k_cache, v_cache, write_cells, rope_c, rope_s, n_heads,
                    eps, group_size, small_rows, packed, int8, attend);
}

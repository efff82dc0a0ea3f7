// The one-call step (model/runner/native.py): every block of a step in C++, each as its
// model.arch.LayerDesc describes it (the parts it has, its window's attention groups, its RoPE
// table), with the kernels the Python layers call (layers.cpp, attention*.cpp, int4.cpp,
// gemm.cpp).
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

// x += m * y as model/layers/decoder.py's Block adds a sublayer: `x + y` at m == 1, else `x + y * m`
// (the product rounded to x's dtype first, as torch does).
void add_residual_(at::Tensor& x, const at::Tensor& y, double m) {
  add_rows_(x, m == 1.0 ? y.contiguous() : at::mul(y, m).contiguous());
}

// oneDNN's linear over a weight prepacked by mkldnn::_reorder_linear_weight (what
// model/layers/quant.py dense_linear runs), through the dispatcher: it has no at:: function.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x,
                          w,
                          bias ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// write_kv: the step's K or V rows [n, n_kv, hd] in x's dtype (row stride src_s0, head stride
// hd) into cells[r] of one layer's cache [n_kv, n_cells, row] (contiguous): raw row copies
// where the cache has x's dtype (what KVStorage.write's index_copy_ stores), else each row
// encoded in the cache's type (kv_rows.cpp, as kvcache/cache_types.py encodes it). The caller
// checked every cell is in range.
void write_kv(const at::Tensor& layer, const int64_t* cells, const char* src, int64_t n,
              int64_t n_kv, int64_t hd, int64_t src_s0, at::ScalarType xt) {
  char* base = static_cast<char*>(layer.data_ptr());
  const CacheKind kind = cache_kind(layer, hd);
  const CacheKind own = xt == at::kFloat ? CacheKind::F32 : CacheKind::BF16;
  const int64_t elem = xt == at::kFloat ? 4 : 2, n_cells = layer.size(1);
  const int64_t row = cache_row_bytes(kind, hd);
  std::vector<float> f(kind == own || xt == at::kFloat ? 0 : hd);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < n_kv; ++h) {
      char* dst = base + (h * n_cells + cells[r]) * row;
      const char* s = src + (r * src_s0 + h * hd) * elem;
      if (kind == own) {
        std::memcpy(dst, s, row);
        continue;
      }
      const float* x = reinterpret_cast<const float*>(s);
      if (xt != at::kFloat) {
        const auto* b = reinterpret_cast<const at::BFloat16*>(s);
        for (int64_t d = 0; d < hd; ++d) f[d] = to_float(b[d]);
        x = f.data();
      }
      encode_row(kind, x, reinterpret_cast<uint8_t*>(dst), hd);
    }
  }
}

// model/layers/decoder.py Attention's q_norm / k_norm: RMSNorm over head_dim of `heads` heads of qkv
// [n, width] starting at column col, written back in place (the Python layers norm a copy and
// cat it: the same values).
void norm_heads_(at::Tensor& qkv, int64_t col, int64_t heads, int64_t hd, const at::Tensor& w,
                 double eps) {
  auto view = qkv.narrow(1, col, heads * hd).view({qkv.size(0), heads, hd});
  auto in = view.contiguous();
  auto out = at::empty_like(in);
  rms_norm_into(in, w, eps, out);
  view.copy_(out);
}

// RoPE on qk [n, heads, hd] (a view of qkv) other than rope_neox_'s whole rotate-half heads
// (GLM-4: the first rot dims of each head, pairs interleaved), in place, with the ATen ops of
// model/layers/decoder.py Attention: qk * c + rope_partner(qk) * s (kvcache/rope.py).
void rope_partial_(at::Tensor& qk, const at::Tensor& c, const at::Tensor& s, int64_t rot,
                   bool interleaved) {
  const int64_t hd = qk.size(2), half = rot / 2;
  std::vector<at::Tensor> parts;
  if (interleaved) {
    auto pairs = qk.slice(2, 0, rot).reshape({qk.size(0), qk.size(1), half, 2});
    parts.push_back(pairs.flip({-1}).flatten(-2));
  } else {
    parts = {qk.slice(2, half, rot), qk.slice(2, 0, half)};
  }
  if (rot < hd) parts.push_back(qk.slice(2, rot));
  qk.copy_(at::addcmul(qk * c, at::cat(parts, -1), s));
}

// One layer's attention output [n, heads, hd] over its window's groups, assembled as
// model/layers/decoder.py's Attention.forward does (index_copy_ of each decode group, a slice copy of
// each chunk; rows in no group are zero); softcap > 0 caps the scores (Gemma 2); sinks: gpt-oss's.
at::Tensor attend(const StepGroups& g, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, double scale, double softcap,
                  const c10::optional<at::Tensor>& sinks) {
  const int64_t n = q.size(0), n_dec = static_cast<int64_t>(g.decode_rows.size());
  const int64_t n_prompt = static_cast<int64_t>(g.prompt_cells.size());
  if (n_dec == 1 && n_prompt == 0 && g.decode_rows[0].numel() == 0)
    return decode_attention(q, k, v, g.decode_cells[0], g.decode_lens[0], scale, softcap, sinks);
  auto out = at::zeros({n, q.size(1), q.size(2)}, q.options());
  for (int64_t i = 0; i < n_dec; ++i) {
    const at::Tensor& rows = g.decode_rows[i];
    TORCH_CHECK(rows.numel() > 0, "step_layers: a group of every row must be the only group");
    out.index_copy_(
        0, rows,
        decode_attention(q.index_select(0, rows), k, v, g.decode_cells[i], g.decode_lens[i],
                         scale, softcap, sinks));
  }
  for (int64_t i = 0; i < n_prompt; ++i) {
    const int64_t start = g.prompt_bounds[2 * i], end = g.prompt_bounds[2 * i + 1];
    out.slice(0, start, end)
        .copy_(prompt_attention(q.slice(0, start, end), k, v, g.prompt_cells[i],
                                g.prompt_lens[i], scale, softcap, sinks, g.prompt_firsts[i]));
  }
  return out;
}

// Every StepGroups well formed and every layer's write cells inside its pool: checked before
// the first write, so that a bad step leaves the cache as it was.
void check_step(const at::Tensor& x, const std::vector<StepLayer>& layers,
                const std::vector<StepGroups>& groups, const std::vector<at::Tensor>& ropes) {
  const int64_t n = x.size(0), n_groups = static_cast<int64_t>(groups.size());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "step_layers: x must be bfloat16 or float32");
  TORCH_CHECK(ropes.size() % 2 == 0, "step_layers: rope tables come in (c, s) pairs");
  for (const auto& g : groups) {
    const int64_t n_dec = static_cast<int64_t>(g.decode_rows.size());
    const int64_t n_prompt = static_cast<int64_t>(g.prompt_cells.size());
    TORCH_CHECK(static_cast<int64_t>(g.decode_cells.size()) == n_dec &&
                    static_cast<int64_t>(g.decode_lens.size()) == n_dec &&
                    static_cast<int64_t>(g.prompt_lens.size()) == n_prompt &&
                    static_cast<int64_t>(g.prompt_firsts.size()) == n_prompt &&
                    static_cast<int64_t>(g.prompt_bounds.size()) == 2 * n_prompt,
                "step_layers: one rows / cells / lens per decode group, one bounds / cells / "
                "lens / firsts per prompt chunk");
    for (int64_t i = 0; i < n_prompt; ++i)
      TORCH_CHECK(0 <= g.prompt_bounds[2 * i] &&
                      g.prompt_bounds[2 * i] < g.prompt_bounds[2 * i + 1] &&
                      g.prompt_bounds[2 * i + 1] <= n,
                  "step_layers: prompt chunk ", i, " is not a range of the batch's ", n, " rows");
    TORCH_CHECK(g.write_cells.scalar_type() == at::kLong && g.write_cells.is_contiguous() &&
                    g.write_cells.numel() == n,
                "step_layers: write_cells must be int64, contiguous, one cell per row");
  }
  // per group, the fewest cells of a pool its layers write into
  std::vector<int64_t> n_cells(n_groups, INT64_MAX);
  for (const auto& layer : layers) {
    if (layer.router) {  // every mixer's layer may have experts
      const int64_t n_experts = layer.router->size(0);
      TORCH_CHECK(layer.router->scalar_type() == x.scalar_type() && layer.router->dim() == 2 &&
                      layer.router->size(1) == x.size(1) && layer.expert_rows &&
                      layer.expert_rows->scalar_type() == at::kLong &&
                      layer.expert_rows->is_contiguous() &&
                      layer.expert_rows->numel() == n_experts &&
                      static_cast<int64_t>(layer.experts_w13.size()) == n_experts &&
                      static_cast<int64_t>(layer.experts_w2.size()) == n_experts &&
                      0 < layer.n_used && layer.n_used <= n_experts &&
                      (!layer.selection_bias ||
                       (layer.selection_bias->scalar_type() == at::kFloat &&
                        layer.selection_bias->numel() == n_experts)),
                  "step_layers: a MoE layer needs a router [n_experts, dim] in x's dtype, "
                  "expert_rows, n_experts gate|up and down linears, 0 < n_used <= n_experts, "
                  "a float32 selection_bias [n_experts] where set");
    }
    if (layer.mamba2) {  // mamba2_mix checks the rest
      TORCH_CHECK(layer.conv_state.dim() == 3 && layer.ssm_state.dim() == 4,
                  "step_layers: a Mamba2 layer needs conv_state and ssm_state");
      TORCH_CHECK(layer.ssm_in.has_value() == layer.ssm_out.has_value(),
                  "step_layers: a parallel Mamba2 mixer needs both ssm_in and ssm_out");
      if (!layer.ssm_in) continue;  // else (Falcon-H1) the attention beside it is checked too
    }
    if (layer.mamba) {  // mamba_mix checks the rest
      TORCH_CHECK(layer.conv_state.dim() == 3 && layer.ssm_state.dim() == 3,
                  "step_layers: a Mamba layer needs conv_state and ssm_state");
      continue;
    }
    if (layer.shortconv) {  // short_conv checks the state's rows and slots
      const auto& c = layer.conv_state;
      TORCH_CHECK(c.dim() == 3 && c.is_contiguous() && c.scalar_type() == x.scalar_type() &&
                      c.size(1) == x.size(1) && layer.conv_w.dim() == 2 &&
                      layer.conv_w.size(0) == x.size(1) && layer.conv_w.size(1) == c.size(2) + 1,
                  "step_layers: a short-convolution layer needs conv_state [n_slots, dim, L - 1] "
                  "in x's dtype and conv_w [dim, L]");
      continue;
    }
    TORCH_CHECK(0 <= layer.groups && layer.groups < n_groups, "step_layers: a layer's groups ",
                layer.groups, " is not one of the step's ", n_groups);
    TORCH_CHECK(layer.rope < static_cast<int64_t>(ropes.size()) / 2,
                "step_layers: a layer's rope table ", layer.rope, " is not given");
    TORCH_CHECK(0 <= layer.rope_dim && layer.rope_dim <= layer.head_dim &&
                    layer.rope_dim % 2 == 0 && layer.softcap >= 0.0,
                "step_layers: a layer's rope_dim must be even, in [0, head_dim]; its softcap "
                ">= 0");
    const auto& k = layer.k_cache;
    TORCH_CHECK(layer.head_dim > 0 && k.dim() == 3 && layer.v_cache.dim() == 3 &&
                    k.is_contiguous() && layer.v_cache.is_contiguous() &&
                    layer.v_cache.size(0) == k.size(0) && layer.v_cache.size(1) == k.size(1),
                "step_layers: a layer's K/V caches must be contiguous [n_kv, n_cells, row], "
                "with its head_dim set");
    cache_kind(k, layer.head_dim);  // rows of a cache type (else it throws)
    cache_kind(layer.v_cache, layer.head_dim);
    n_cells[layer.groups] = std::min(n_cells[layer.groups], k.size(1));
  }
  for (int64_t i = 0; i < n_groups; ++i) {
    const int64_t* cp = groups[i].write_cells.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(cp[r] >= 0 && cp[r] < n_cells[i], "step_layers: write_cells[", r, "] = ",
                  cp[r], " is not in [0, ", n_cells[i], ")");
  }
}

// an expert's activation of its rows' gate | up [rows, 2 f] -> [rows, f]: SiLU(gate) * up, or
// gpt-oss's clamped SwiGLU (the ATen ops of blocks.py swiglu_oai, in its order)
at::Tensor expert_act(const at::Tensor& gate_up, const StepLayer& layer) {
  const int64_t f = gate_up.size(1) / 2;
  if (layer.swiglu_limit > 0.0) {
    const double limit = layer.swiglu_limit;
    auto gate = at::clamp_max(gate_up.slice(1, 0, f), limit);
    auto up = at::clamp(gate_up.slice(1, f), -limit, limit);
    auto glu = at::mul(gate, at::sigmoid(at::mul(gate, layer.swiglu_alpha)));
    return at::mul(at::add(up, 1), glu);
  }
  auto gated = at::empty({gate_up.size(0), f}, gate_up.options());
  silu_mul_into(gate_up.contiguous(), gated);
  return gated;
}

// every expert on a GGUF's own blocks (ggml_linear)
bool all_ggml(const StepLayer& layer) {
  for (size_t e = 0; e < layer.experts_w13.size(); ++e)
    if (layer.experts_w13[e].kind != "ggml" || layer.experts_w2[e].kind != "ggml") return false;
  return true;
}

// The experts' SwiGLU (or gpt-oss's clamped one) on their grouped rows xs [n k, dim] (expert e's
// rows [start[e], start[e] + counts[e])): both linears of every used expert in one
// ggml_linear_segments call each, not two calls an expert (a decode row's 8 experts were 16
// parallel regions a layer, each quantizing its row again). Each expert's rows get the bits
// its own quant_linear calls give (the Python layer's, model/layers/moe.py): the segments' y
// are ggml_linear's of those rows alone, the biases added per expert as quant_linear adds them,
// and the activation is elementwise.
at::Tensor ggml_experts(const at::Tensor& xs, const StepLayer& layer,
                        const std::vector<int64_t>& start, const std::vector<int64_t>& counts) {
  std::vector<int64_t> starts{0}, used;
  std::vector<std::vector<at::Tensor>> p13, p2;
  std::vector<std::vector<int64_t>> t13, t2;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (!counts[e]) continue;
    used.push_back(static_cast<int64_t>(e));
    starts.push_back(start[e] + counts[e]);
    p13.push_back(layer.experts_w13[e].parts);
    t13.push_back(layer.experts_w13[e].types);
    p2.push_back(layer.experts_w2[e].parts);
    t2.push_back(layer.experts_w2[e].types);
  }
  auto add_biases = [&](at::Tensor y, const std::vector<StepLinear>& lins) {
    for (size_t i = 0; i < used.size(); ++i)
      if (lins[used[i]].bias) y.slice(0, starts[i], starts[i + 1]).add_(*lins[used[i]].bias);
    return y;
  };
  auto gate_up = add_biases(ggml_linear_segments(xs, starts, p13, t13, xs.size(1)),
                            layer.experts_w13);
  // the clamped SwiGLU per expert, as the loop computes it (ATen's vectorized ops treat a
  // tensor's tail elements apart: the same rows in a bigger tensor could round otherwise)
  auto gated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, xs.options());
  if (layer.swiglu_limit > 0.0) {
    for (size_t i = 0; i < used.size(); ++i)
      gated.slice(0, starts[i], starts[i + 1])
          .copy_(expert_act(gate_up.slice(0, starts[i], starts[i + 1]), layer));
  } else {  // silu_mul computes row by row: one call over every used expert's rows
    silu_mul_into(gate_up.contiguous(), gated);
  }
  return add_biases(ggml_linear_segments(gated, starts, p2, t2, gated.size(1)),
                    layer.experts_w2);
}

// up to this many (row, expert) pairs a step (decode rows of a few sequences), moe_ffn adds the
// weighted outputs back in one loop instead of four ATen calls
constexpr int64_t kFewPairs = 64;

// the weighted outputs ys [n k, dim] (pairs in `order`, pair i = row i / k) added back per row
// in the order of the pairs: ys * w rounded to h's dtype, then added in float32 and rounded,
// as the Python layer's ys.mul_(w) and index_add_ (a few rows: no ATen calls per op)
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_weighted(T* out, const T* ys,
                                                               const T* w, const int64_t* order,
                                                               int64_t nk, int64_t k, int64_t d) {
  for (int64_t i = 0; i < nk; ++i) {
    T* o = out + (order[i] / k) * d;
    const T* y = ys + i * d;
    const float wi = static_cast<float>(w[order[i]]);
    for (int64_t c = 0; c < d; ++c)
      o[c] = static_cast<T>(static_cast<float>(o[c]) +
                            static_cast<float>(static_cast<T>(static_cast<float>(y[c]) * wi)));
  }
}

// model/layers/moe.py MoEFeedForward.forward on h [n, dim] (SwiGLU experts): moe_route's
// experts and weights (cast to h's dtype); the (row, slot) pairs grouped by expert in a
// stable counting sort (the permutation of the Python layer's stable argsort), each chosen
// expert once over all its rows, the weighted outputs added back per row in ascending expert
// order (index_add_); layer.expert_rows counts the pairs.
at::Tensor moe_ffn(const at::Tensor& h, const StepLayer& layer, int64_t group_size) {
  const int64_t n = h.size(0), k = layer.n_used;
  const int64_t n_experts = static_cast<int64_t>(layer.experts_w13.size());
  c10::optional<at::Tensor> router_bias;
  if (layer.router_bias) router_bias = *layer.router_bias;
  auto logits = at::linear(h, *layer.router, router_bias);  // [n, n_experts]
  auto [weights, idx] = moe_route(logits, k, layer.norm_topk, layer.sigmoid_gating,
                                  layer.selection_bias, layer.weights_scale);
  auto top = weights.to(h.scalar_type()).contiguous();
  const int64_t* e_of = idx.data_ptr<int64_t>();
  std::vector<int64_t> counts(n_experts, 0), start(n_experts + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) ++counts[e_of[i]];
  for (int64_t e = 0; e < n_experts; ++e) start[e + 1] = start[e] + counts[e];
  auto order = at::empty({n * k}, idx.options());
  auto rows = at::empty({n * k}, idx.options());
  int64_t* op = order.data_ptr<int64_t>();
  int64_t* rp = rows.data_ptr<int64_t>();
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n * k; ++i) op[fill[e_of[i]]++] = i;
  for (int64_t i = 0; i < n * k; ++i) rp[i] = op[i] / k;
  int64_t* load = layer.expert_rows->data_ptr<int64_t>();
  for (int64_t e = 0; e < n_experts; ++e) load[e] += counts[e];
  auto xs = h.index_select(0, rows);  // [n k, dim], expert by expert
  at::Tensor ys;
  if (all_ggml(layer)) {
    ys = ggml_experts(xs, layer, start, counts);
  } else {
    ys = at::empty_like(xs);
    for (int64_t e = 0; e < n_experts; ++e) {
      if (!counts[e]) continue;
      auto gate_up = quant_linear(xs.slice(0, start[e], start[e + 1]), layer.experts_w13[e],
                                  group_size)
                         .contiguous();
      auto gated = expert_act(gate_up, layer);
      ys.slice(0, start[e], start[e + 1])
          .copy_(quant_linear(gated, layer.experts_w2[e], group_size));
    }
  }
  if (n * k > kFewPairs || !h.is_contiguous() || !ys.is_contiguous()) {
    ys.mul_(top.reshape(-1).index_select(0, order).unsqueeze(1));
    return at::zeros_like(h).index_add_(0, rows, ys);
  }
  auto out = at::zeros_like(h);
  const int64_t d = h.size(1);
  if (h.scalar_type() == at::kBFloat16)
    add_weighted(out.data_ptr<at::BFloat16>(), ys.data_ptr<at::BFloat16>(),
                 top.data_ptr<at::BFloat16>(), op, n * k, k, d);
  else
    add_weighted(out.data_ptr<float>(), ys.data_ptr<float>(), top.data_ptr<float>(), op, n * k,
                 k, d);
  return out;
}

}  // namespace

// The kernel a quantized linear runs, by its kind, row count and the rows' dtype (kernels.h
// StepLinear): model/layers/quant.py QuantLinear.forward calls it for every linear that has a
// kind for its rows' dtype (QuantLinear.step_kind), step_layers for each of a step's.
at::Tensor quant_linear(const at::Tensor& a, const StepLinear& w, int64_t group_size) {
  auto with_bias = [&w](at::Tensor y) { return w.bias ? at::add(y, *w.bias) : y; };
  if (w.kind == "ggml") {  // the bias added in place: y keeps the rows' dtype whatever the bias's
    auto y = ggml_linear(a, w.parts, w.types, a.size(1));
    return w.bias ? y.add_(*w.bias) : y;
  }
  const bool small = a.size(0) <= w.small_rows;
  if (w.kind == "int4_f32") {
    TORCH_CHECK(a.scalar_type() == at::kFloat, "quant_linear: int4_f32 takes float32 rows");
    return with_bias(small ? int4_mm(a, w.w0, w.w1) : int4_gemm(a, w.w2, w.w0.size(0)));
  }
  if (small) {
    if (w.kind == "q8") {
      TORCH_CHECK(a.scalar_type() == at::kFloat, "quant_linear: q8 takes float32 rows");
      return with_bias(int8_mm(a, w.w0, w.w1));
    }
    if (w.kind == "int8") {
      if (a.scalar_type() == at::kBFloat16) return with_bias(at::_weight_int8pack_mm(a, w.w0, w.w1));
      auto y = with_bias(at::_weight_int8pack_mm(a.to(at::kBFloat16), w.w0, w.w1));
      return y.to(a.scalar_type());
    }
    TORCH_CHECK(w.kind == "int4" && a.scalar_type() == at::kBFloat16,
                "quant_linear: a linear of kind '", w.kind, "' on ", a.scalar_type(), " rows");
    return with_bias(at::_weight_int4pack_mm_for_cpu(a, w.w0, group_size, w.w1));
  }
  const auto dense = w.w2.scalar_type();
  const at::Tensor in = a.scalar_type() == dense ? a : a.to(dense);
  auto y = w.packed ? packed_linear(in, w.w2, w.dense_bias) : at::linear(in, w.w2, w.dense_bias);
  return y.scalar_type() == a.scalar_type() ? y : y.to(a.scalar_type());
}

// One attention layer's mixer output [n, dim] (before post_attn_norm and the residual): qkv of
// the normed rows `in`, q/k norms, RoPE, the K/V rows written to their cells, attention over the
// layer's window's groups, wo.
template <typename MM>
at::Tensor attention(const at::Tensor& x, const at::Tensor& in, const StepLayer& layer,
                     const std::vector<StepGroups>& groups,
                     const std::vector<at::Tensor>& rope_tables, int64_t n_heads, double eps,
                     double scale, const MM& mm) {
  const int64_t n = x.size(0), elem = static_cast<int64_t>(x.element_size());
  const int64_t n_kv = layer.k_cache.size(0), hd = layer.head_dim;
  const int64_t qk_width = (n_heads + n_kv) * hd, width = qk_width + n_kv * hd;
  auto qkv = mm(in, layer.wqkv);  // [n, width]
  TORCH_CHECK(qkv.size(1) == width, "step_layers: wqkv gives ", qkv.size(1), " columns, not ",
              width);
  if (layer.q_norm && layer.k_norm) {  // per head, or (OLMoE) over the whole projection
    const bool whole = layer.q_norm->numel() != hd;
    norm_heads_(qkv, 0, whole ? 1 : n_heads, whole ? n_heads * hd : hd, *layer.q_norm, eps);
    norm_heads_(qkv, n_heads * hd, whole ? 1 : n_kv, whole ? n_kv * hd : hd, *layer.k_norm,
                eps);
  }
  if (layer.rope >= 0) {
    auto qk = qkv.as_strided({n, n_heads + n_kv, hd}, {width, hd, 1});
    const at::Tensor &c = rope_tables[2 * layer.rope], &s = rope_tables[2 * layer.rope + 1];
    const int64_t rot = layer.rope_dim ? layer.rope_dim : hd;
    if (rot == hd && !layer.rope_interleaved)
      rope_neox_(qk, c, s);
    else
      rope_partial_(qk, c, s, rot, layer.rope_interleaved);
  }
  if (layer.k_center)  // k - c: q . c is the same for every key (kvcache/rotation.py)
    qkv.as_strided({n, n_kv, hd}, {width, hd, 1}, n_heads * hd).sub_(*layer.k_center);
  if (layer.rot_k)  // q and k together, as model/layers/decoder.py Attention does
    hadamard_(qkv.as_strided({n, n_heads + n_kv, hd}, {width, hd, 1}), layer.rot_k);
  if (layer.rot_v) hadamard_(qkv.as_strided({n, n_kv, hd}, {width, hd, 1}, qk_width), layer.rot_v);
  const StepGroups& g = groups[layer.groups];
  const char* base = static_cast<const char*>(qkv.data_ptr());
  const int64_t* wc = g.write_cells.data_ptr<int64_t>();
  write_kv(layer.k_cache, wc, base + n_heads * hd * elem, n, n_kv, hd, width, x.scalar_type());
  write_kv(layer.v_cache, wc, base + qk_width * elem, n, n_kv, hd, width, x.scalar_type());
  auto q = qkv.as_strided({n, n_heads, hd}, {width, hd, 1});
  c10::optional<at::Tensor> sinks;
  if (layer.sinks) sinks = *layer.sinks;
  auto attn = attend(g, q, layer.k_cache, layer.v_cache, scale, layer.softcap, sinks);
  if (layer.rot_v) hadamard_(attn, layer.rot_v);  // H v's weighted sum, rotated back
  return mm(attn.view({n, n_heads * hd}), layer.wo);
}

// step_layers: every layer of a step in one call (decode rows, prompt chunks or both), bfloat16
// or float32 activations, weights of model/layers/quant.py QuantLinear (int4, int8, q8): the same ops,
// in the same order, as model/layers/decoder.py's Block for each layer's LayerDesc (StepLayer holds
// the parts it has), without the Python between them, and without ATen calls where a raw pass
// gives the same bits: RoPE in place (rope_neox_, which the Python layers call too), K/V rows
// memcpy'd into their cells (KVStorage.write's index_copy_), residual adds into one stream
// (torch's x + y, rounded once), one RMSNorm and one SiLU-mul buffer for all layers. Each
// linear picks its kernel by its kind and row count (quant_linear). groups: one
// StepGroups per window the layers attend through; rope_tables: (c, s) pairs [n, 1, head_dim]
// in x's dtype (kvcache.rope.rope_tables), the full layers' then the sliding ones'. Returns
// the hidden state after the last layer.
at::Tensor step_layers(at::Tensor x, const std::vector<StepLayer>& layers,
                       const std::vector<StepGroups>& groups,
                       const std::vector<at::Tensor>& rope_tables, int64_t n_heads, double eps,
                       double scale, int64_t group_size, const StepState& state) {
  check_step(x, layers, groups, rope_tables);
  auto mm = [group_size](const at::Tensor& a, const StepLinear& w) {
    return quant_linear(a, w, group_size).contiguous();
  };
  const int64_t n = x.size(0);
  x = x.contiguous().clone();  // NOTE: the residual stream, updated in place layer by layer
  auto normed = at::empty_like(x);  // each RMSNorm's output, reused across layers
  at::Tensor gated;                  // [n, ffn]: each SiLU-mul's output, reused
  for (const StepLayer& layer : layers) {
    if (layer.attn_norm) rms_norm_into(x, *layer.attn_norm, eps, normed);
    at::Tensor a;
    if (layer.shortconv) {  // model/layers/shortconv.py: out_proj(C * conv(B * x))
      auto bcx = mm(layer.attn_norm ? normed : x, layer.wqkv);  // [n, 3 dim]: B, C, x
      const int64_t d = bcx.size(1) / 3;
      auto v = at::mul(bcx.slice(1, 0, d), bcx.slice(1, 2 * d));
      auto w = short_conv(v, layer.conv_state, layer.conv_w, state);
      a = mm(at::mul(bcx.slice(1, d, 2 * d), w), layer.wo);
    } else if (layer.mamba2 && !layer.ssm_in) {  // mamba2.py: out_proj(mixer(in_proj(x)))
      auto zxbcdt = mm(layer.attn_norm ? normed : x, layer.wqkv);
      a = mm(mamba2_mix(zxbcdt, layer.conv_state, layer.ssm_state, *layer.mamba2, state),
             layer.wo);
    } else if (layer.mamba) {  // model/layers/mamba.py: out_proj(mixer(in_proj(x)))
      auto xz = mm(layer.attn_norm ? normed : x, layer.wqkv);
      a = mm(mamba_mix(xz, layer.conv_state, layer.ssm_state, *layer.mamba, state), layer.wo);
    } else if (layer.ssm_in) {  // Falcon-H1 (decoder.py Block): the Mamba2 mixer, then the
      // attention on the same input, their sum
      const at::Tensor& in = layer.attn_norm ? normed : x;
      auto mixed = mamba2_mix(mm(in, *layer.ssm_in), layer.conv_state, layer.ssm_state,
                              *layer.mamba2, state);
      auto s = mm(mixed, *layer.ssm_out);
      a = at::add(attention(x, in, layer, groups, rope_tables, n_heads, eps, scale, mm), s);
    } else {
      a = attention(x, layer.attn_norm ? normed : x, layer, groups, rope_tables, n_heads, eps,
                    scale, mm);
    }
    if (layer.post_attn_norm) {
      rms_norm_into(a, *layer.post_attn_norm, eps, normed);
      a = normed;
    }
    add_residual_(x, a, layer.residual_mult);
    if (!layer.ffn) continue;  // a block without an MLP half (Mamba2)
    if (layer.ffn_norm) rms_norm_into(x, *layer.ffn_norm, eps, normed);
    const at::Tensor& ffn_in = layer.ffn_norm ? normed : x;
    if (layer.router) {
      auto out = moe_ffn(ffn_in, layer, group_size);
      if (layer.shared_expert) {  // model/layers/moe.py: the shared expert, added last
        auto shared_gate_up = mm(ffn_in, layer.w13);
        auto shared_hidden = at::empty({n, shared_gate_up.size(1) / 2}, x.options());
        silu_mul_into(shared_gate_up, shared_hidden);
        auto shared = mm(shared_hidden, layer.w2);
        if (layer.shexp_gate) shared.mul_(at::sigmoid(at::linear(ffn_in, *layer.shexp_gate)));
        out.add_(shared);
      }
      add_residual_(x, out, layer.residual_mult);
      continue;
    }
    auto gate_up = mm(ffn_in, layer.w13);  // [n, 2 ffn]: gate, up
    const int64_t f = gate_up.size(1) / 2;
    at::Tensor hidden;
    if (layer.gelu) {  // model/layers/blocks.py FeedForward: gelu(gate, tanh) * up, two ATen ops
      hidden = at::mul(at::gelu(gate_up.slice(1, 0, f), "tanh"), gate_up.slice(1, f));
    } else {
      if (!gated.defined() || gated.size(1) != f) gated = at::empty({n, f}, x.options());
      silu_mul_into(gate_up, gated);
      hidden = gated;
    }
    auto out = mm(hidden, layer.w2);
    if (layer.post_ffn_norm) {
      rms_norm_into(out, *layer.post_ffn_norm, eps, normed);
      out = normed;
    }
    add_residual_(x, out, layer.residual_mult);
  }
  return x;
}

// the top-k scores' sum is divided by at least this (llama.cpp's clamp in build_moe_ffn): k
// sigmoid scores can all underflow to 0
constexpr float kMinWeightSum = 6.103515625e-5f;

// NOTE: not vectorized. GCC vectorized the exp loops (libmvec's vector expf, then scalar expf
// for the rest) behind a run-time check that `p` (heap) does not overlap the logits row; where
// the heap put `p` just past the logits tensor, that row took the scalar expf and its weights
// moved by an ulp: the same logits routed to other bits now and then (the one-call step against
// the Python layers, both calling this, differed in ~1 of 6 runs on an Intel Xeon). Scalar expf
// everywhere gives a row the same bits wherever its buffers lie (tests/model/test_moe.py).
__attribute__((optimize("no-tree-vectorize")))
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits_in, int64_t k, bool norm_topk,
                                             bool sigmoid,
                                             const std::optional<at::Tensor>& selection_bias,
                                             double scale) {
  TORCH_CHECK(logits_in.dim() == 2 && 0 < k && k <= logits_in.size(1),
              "moe_route: logits [n, n_experts] and 0 < k <= n_experts");
  auto logits = logits_in.to(at::kFloat).contiguous();
  const int64_t n = logits.size(0), n_experts = logits.size(1);
  at::Tensor bias;
  if (selection_bias) {
    TORCH_CHECK(selection_bias->scalar_type() == at::kFloat &&
                    selection_bias->numel() == n_experts,
                "moe_route: selection_bias must be float32 [n_experts]");
    bias = selection_bias->contiguous();
  }
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  auto weights = at::empty({n, k}, logits.options());
  auto experts = at::empty({n, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ep = experts.data_ptr<int64_t>();
  std::vector<float> p(n_experts), q(n_experts);
  std::vector<char> taken(n_experts);
  for (int64_t r = 0; r < n; ++r) {
    const float* l = lp + r * n_experts;
    if (sigmoid) {
      for (int64_t e = 0; e < n_experts; ++e) {  // exp of a non-positive value: never inf
        const float z = std::exp(-std::fabs(l[e]));   // (-ffast-math assumes no infinities)
        p[e] = l[e] >= 0.0f ? 1.0f / (1.0f + z) : z / (1.0f + z);
      }
    } else {
      float m = l[0], sum = 0.0f;
      for (int64_t e = 1; e < n_experts; ++e) m = std::max(m, l[e]);
      for (int64_t e = 0; e < n_experts; ++e) sum += (p[e] = std::exp(l[e] - m));
      for (int64_t e = 0; e < n_experts; ++e) p[e] /= sum;
    }
    for (int64_t e = 0; e < n_experts; ++e) q[e] = bp ? p[e] + bp[e] : p[e];
    std::fill(taken.begin(), taken.end(), 0);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < n_experts; ++e)
        if (!taken[e] && (best < 0 || q[e] > q[best])) best = e;
      taken[best] = 1;
      ep[r * k + j] = best;
      sum += (wp[r * k + j] = p[best]);
    }
    for (int64_t j = 0; j < k; ++j) {
      if (norm_topk) wp[r * k + j] /= std::max(sum, kMinWeightSum);
      if (scale != 1.0) wp[r * k + j] *= static_cast<float>(scale);
    }
  }
  return {weights, experts};
}

// mamba2_mix: the Mamba2 mixer between its two linears (model/layers/mamba2.py's Mamba2Mixer,
// whose torch ops it follows one for one): the depthwise causal conv over the conv state, the
// SSM over the ssm state (one recurrence step per decode row; the chunked SSD scan for a prompt
// chunk, split at its captures), the D skip and the gated RMSNorm. The Python layers call it
// where the kernels are loaded and step_layers calls it in the one-call step, so both give the
// same bits; without the kernels the Python torch ops are the float32 reference.
#include "kernels.h"

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using at::indexing::Slice;

// -inf without a literal the -ffast-math build may assume away
float neg_inf() {
  const uint32_t bits = 0xff800000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// window [.., conv_dim, K] (oldest first) -> silu(depthwise conv) [.., conv_dim]
at::Tensor conv_out(const at::Tensor& window, const StepMamba2& m) {
  auto out = (window * m.conv_w).sum(-1);
  return at::silu(m.conv_b ? out + *m.conv_b : out);
}

struct SsmInputs {
  at::Tensor x, b, c, dt;  // [L, H, P], [L, G, N], [L, G, N], [L, H]: float32
};

SsmInputs ssm_inputs(const at::Tensor& xbc, const at::Tensor& dt, const StepMamba2& m) {
  const int64_t gn = m.n_groups * m.d_state;
  auto parts = xbc.to(at::kFloat).split_with_sizes({m.d_inner, gn, gn}, -1);
  auto b = parts[1].unflatten(-1, {m.n_groups, m.d_state});
  auto c = parts[2].unflatten(-1, {m.n_groups, m.d_state});
  auto d = at::softplus(dt.to(at::kFloat) + m.dt_bias.to(at::kFloat));
  return {parts[0].unflatten(-1, {m.n_heads, m.head_dim}), b, c, d};
}

// The chunked SSD scan (mamba2.py ssd_scan): x [L, H, P], dt [L, H], a [H], b, c [L, G, N],
// state [H, P, N] -> y [L, H, P] (without the D skip) and the state after the L rows.
std::pair<at::Tensor, at::Tensor> ssd_scan(const at::Tensor& x, const at::Tensor& dt,
                                           const at::Tensor& a, const at::Tensor& b,
                                           const at::Tensor& c, at::Tensor state,
                                           int64_t chunk) {
  const int64_t n_rows = x.size(0), h = x.size(1), p = x.size(2), g = b.size(1), n = b.size(2);
  const int64_t hg = h / g;
  auto xh = x.permute({1, 0, 2}), dth = dt.t();
  auto bg = b.permute({1, 0, 2}), cg = c.permute({1, 0, 2});
  std::vector<at::Tensor> ys;
  for (int64_t lo = 0; lo < n_rows; lo += chunk) {
    const int64_t hi = std::min(lo + chunk, n_rows), t = hi - lo;
    auto acum = at::cumsum(dth.index({Slice(), Slice(lo, hi)}) * a.unsqueeze(1), 1);
    auto seg = acum.unsqueeze(2) - acum.unsqueeze(1);
    auto causal = at::ones({t, t}, at::TensorOptions().dtype(at::kBool)).tril_();
    auto decay = at::exp(seg.masked_fill_(causal.logical_not(), neg_inf()));
    auto bc = bg.index({Slice(), Slice(lo, hi)}), cc = cg.index({Slice(), Slice(lo, hi)});
    auto scores = decay.view({g, hg, t, t}) * at::bmm(cc, bc.transpose(1, 2)).unsqueeze(1);
    auto xdt = xh.index({Slice(), Slice(lo, hi)}) * dth.index({Slice(), Slice(lo, hi)}).unsqueeze(2);
    auto y = at::bmm(scores.view({h, t, t}), xdt);
    auto from_state = at::bmm(cc, state.view({g, hg * p, n}).transpose(1, 2));
    from_state = from_state.view({g, t, hg, p}).transpose(1, 2).reshape({h, t, p});
    ys.push_back(y + from_state * at::exp(acum).unsqueeze(2));
    auto to_end = at::exp(acum.index({Slice(), Slice(-1, at::indexing::None)}) - acum);
    auto w = (xdt * to_end.unsqueeze(2)).view({g, hg, t, p}).transpose(2, 3).reshape({g, hg * p, t});
    state = state * at::exp(acum.index({Slice(), -1})).unsqueeze(1).unsqueeze(2) +
            at::bmm(w, bc).view({h, p, n});
  }
  return {at::cat(ys, 1).transpose(0, 1), state};
}

// decode rows: one token per sequence, their slots' states move one step (mamba2.py _step)
at::Tensor step(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv, at::Tensor& ssm,
                const at::Tensor& slots, int64_t run_lo, int64_t run_hi, const StepMamba2& m) {
  auto window = at::cat({conv.index_select(0, slots), xbc.to(conv.scalar_type()).unsqueeze(2)}, 2);
  conv.index_copy_(0, slots, window.index({Slice(), Slice(), Slice(1, at::indexing::None)}));
  auto in = ssm_inputs(conv_out(window, m), dt, m);
  const int64_t n_seq = in.x.size(0), g = m.n_groups, hgp = m.d_inner / m.n_groups;
  auto st = run_lo >= 0 ? ssm.index({Slice(run_lo, run_hi)}) : ssm.index_select(0, slots);
  st.mul_(at::exp(in.dt * m.a.to(at::kFloat)).unsqueeze(2).unsqueeze(3));
  auto grouped = st.view({n_seq * g, hgp, m.d_state});
  auto xdt = (in.dt.unsqueeze(2) * in.x).reshape({n_seq * g, hgp, 1});
  grouped.baddbmm_(xdt, in.b.reshape({n_seq * g, 1, m.d_state}));
  if (run_lo < 0) ssm.index_copy_(0, slots, st);
  auto y = at::linalg_vecdot(grouped, in.c.reshape({n_seq * g, 1, m.d_state}));
  return y.view_as(in.x) + m.d.to(at::kFloat).unsqueeze(1) * in.x;
}

// a prompt chunk from its slot's state, split at its captures (mamba2.py _scan)
at::Tensor scan(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv, at::Tensor& ssm,
                int64_t slot, const std::vector<std::pair<int64_t, int64_t>>& captures,
                const StepMamba2& m) {
  const int64_t k1 = m.d_conv - 1, n = xbc.size(0);
  auto raw = at::cat({conv[slot], xbc.to(conv.scalar_type()).t()}, 1);
  const int64_t one = 1, zero = 0;
  auto out = at::conv1d(raw.unsqueeze(0), m.conv_w.unsqueeze(1), m.conv_b, at::IntArrayRef(one),
                        at::IntArrayRef(zero), at::IntArrayRef(one), raw.size(0));
  auto in = ssm_inputs(at::silu(out[0]).t(), dt, m);
  auto a = m.a.to(at::kFloat);
  at::Tensor st = ssm[slot];
  std::vector<at::Tensor> ys;
  int64_t lo = 0;
  auto cuts = captures;
  cuts.emplace_back(n, slot);
  for (const auto& [r, to] : cuts) {
    if (r > lo) {
      auto rows = Slice(lo, r);
      auto [y, next] = ssd_scan(in.x.index({rows}), in.dt.index({rows}), a, in.b.index({rows}),
                                in.c.index({rows}), st, m.scan_chunk);
      ys.push_back(y);
      st = next;
    }
    conv[to].copy_(raw.index({Slice(), Slice(r, r + k1)}));
    ssm[to].copy_(st);
    lo = r;
  }
  return at::cat(ys) + m.d.to(at::kFloat).unsqueeze(1) * in.x;
}

}  // namespace

at::Tensor mamba2_mix(const at::Tensor& zxbcdt, at::Tensor conv, at::Tensor ssm,
                      const StepMamba2& m, const StepState& state) {
  const int64_t n = zxbcdt.size(0);
  TORCH_CHECK(zxbcdt.dim() == 2 && zxbcdt.size(1) >= m.d_inner + m.conv_dim + m.n_heads,
              "mamba2_mix: zxbcdt [n, >= d_inner + conv_dim + n_heads]");
  TORCH_CHECK(conv.dim() == 3 && conv.size(1) == m.conv_dim && conv.size(2) == m.d_conv - 1 &&
                  ssm.dim() == 4 && ssm.scalar_type() == at::kFloat && ssm.size(0) == conv.size(0) &&
                  ssm.size(1) == m.n_heads && ssm.size(2) == m.head_dim &&
                  ssm.size(3) == m.d_state && m.n_heads % m.n_groups == 0 &&
                  m.d_inner == m.n_heads * m.head_dim &&
                  m.conv_dim == m.d_inner + 2 * m.n_groups * m.d_state && m.scan_chunk > 0,
              "mamba2_mix: conv [n_slots, conv_dim, d_conv - 1] and float32 ssm [n_slots, H, P, "
              "N] must match the mixer's sizes");
  check_state(state, n, conv.size(0), "mamba2_mix");
  auto parts = zxbcdt.index({Slice(), Slice(0, m.d_inner + m.conv_dim + m.n_heads)})
                   .split_with_sizes({m.d_inner, m.conv_dim, m.n_heads}, -1);
  const at::Tensor &z = parts[0], &xbc = parts[1], &dt = parts[2];
  auto y = at::zeros({n, m.n_heads, m.head_dim}, zxbcdt.options().dtype(at::kFloat));
  const int64_t n_dec = state.decode_slots.defined() ? state.decode_slots.numel() : 0;
  if (n_dec) {
    const bool all_rows = !state.decode_rows.defined() || state.decode_rows.numel() == 0;
    if (all_rows) {
      y = step(xbc, dt, conv, ssm, state.decode_slots, state.decode_run_lo, state.decode_run_hi, m);
    } else {
      const auto& rows = state.decode_rows;
      auto part = step(xbc.index_select(0, rows), dt.index_select(0, rows), conv, ssm,
                       state.decode_slots, state.decode_run_lo, state.decode_run_hi, m);
      y.index_copy_(0, rows, part);
    }
  }
  const int64_t n_prompt = static_cast<int64_t>(state.prompt_slots.size());
  for (int64_t p = 0; p < n_prompt; ++p) {
    const auto caps = captures_of(state, p);
    const int64_t start = state.prompt_bounds[2 * p], end = state.prompt_bounds[2 * p + 1];
    auto rows = Slice(start, end);
    y.index_put_({rows}, scan(xbc.index({rows}), dt.index({rows}), conv, ssm,
                              state.prompt_slots[p], caps, m));
  }
  // the gated RMSNorm over each of the G groups of y * silu(z) (norm_before_gate=False), of y
  // then gated (norm 1), or the gate alone (norm 2)
  const auto gate = at::silu(z.to(at::kFloat));
  auto g = y.view({n, m.d_inner});
  if (m.norm == 2) return (g * gate).to(zxbcdt.scalar_type());
  if (m.norm == 0) g = g * gate;
  g = g.unflatten(-1, {m.n_groups, m.d_inner / m.n_groups});
  g = g * at::rsqrt(g.pow(2).mean(-1, true) + m.eps);
  g = g.flatten(-2) * m.norm_w.to(at::kFloat);
  return (m.norm == 1 ? g * gate : g).to(zxbcdt.scalar_type());
}

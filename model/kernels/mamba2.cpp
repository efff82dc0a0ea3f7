// mamba2_mix: the Mamba2 mixer between its two linears (model/layers/mamba2.py's Mamba2Mixer,
// whose torch ops it follows one for one): the depthwise causal conv over the conv state, the
// SSM over the ssm state (one recurrence step per decode row; the chunked SSD scan for a prompt
// chunk, split at its captures), the D skip and the gated RMSNorm. The Python layers call it
// where the kernels are loaded and step_layers calls it in the one-call step, so both give the
// same bits; without the kernels the Python torch ops are the float32 reference.
#include "kernels.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
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

constexpr int64_t kConvBlock = 128;  // channels conv_out takes through its local arrays
constexpr int64_t kMaxConv = 8;  // d_conv it takes (Mamba2's: 4); longer ones go to ATen

// windows [R, conv_dim, K] (oldest first) -> silu(depthwise conv) [R, conv_dim] float32. The
// decode rows and a short chunk's rows (scan's row-by-row path) both come here, so a row's conv
// is the same bits whichever way it ran (at::conv1d, the long chunks', sums in another order).
// Every (row, channel) goes through the same loops over local 64-byte aligned blocks of
// kConvBlock channels: what GCC vectorizes (libmvec's expf for the SiLU) splits a block into a
// vector body and tail by channel alone, never by R or by where the tensors lie.
at::Tensor conv_out(const at::Tensor& window, const StepMamba2& m) {
  const int64_t rows = window.size(0), ch = window.size(1), k = window.size(2);
  if (k > kMaxConv) {
    auto out = (window * m.conv_w).sum(-1);
    return at::silu(m.conv_b ? out + *m.conv_b : out).to(at::kFloat);
  }
  auto w = window.to(at::kFloat).contiguous();
  auto cw = m.conv_w.to(at::kFloat).contiguous();
  auto cb = m.conv_b ? m.conv_b->to(at::kFloat).contiguous() : at::zeros({ch}, w.options());
  auto out = at::empty({rows, ch}, w.options());
  const float *w_p = w.data_ptr<float>(), *cw_p = cw.data_ptr<float>();
  const float* cb_p = cb.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t blocks = (ch + kConvBlock - 1) / kConvBlock;
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float win[kConvBlock * kMaxConv], wt[kConvBlock * kMaxConv];
    alignas(64) float acc[kConvBlock], bias[kConvBlock], e[kConvBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / blocks, c0 = (t % blocks) * kConvBlock;
      const int64_t len = std::min(kConvBlock, ch - c0);
      std::memcpy(win, w_p + (r * ch + c0) * k, len * k * sizeof(float));
      std::memcpy(wt, cw_p + c0 * k, len * k * sizeof(float));
      std::memcpy(bias, cb_p + c0, len * sizeof(float));
      for (int64_t i = 0; i < len; ++i) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) sum += win[i * k + j] * wt[i * k + j];
        acc[i] = sum + bias[i];
      }
      for (int64_t i = 0; i < len; ++i) e[i] = std::exp(-acc[i]);
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / (1.0f + e[i]);
      std::memcpy(out_p + r * ch + c0, acc, len * sizeof(float));
    }
  });
  return out;
}

struct SsmInputs {
  at::Tensor x, b, c, dt;  // [L, H, P], [L, G, N], [L, G, N], [L, H]: float32
};

constexpr int64_t kMaxHeads = 1024;  // dt_softplus's local row (Mamba2-2.7B: 80 heads)

// softplus(dt + dt_bias) [.., H] -> float32, a row at a time through one local, 64-byte aligned
// row: whatever GCC vectorizes (libmvec's expf / log1pf) splits every row into the same vector
// body and tail, so an element's bits depend on its head alone, never on how many rows came
// with it or where the tensors lie. ATen's softplus over [L, H] took an element through its
// vector body or its scalar tail by its place in the whole tensor (H = 24: the last 8 of a
// single row went through the tail, of 5 rows through the body), so a row's dt, and through
// it every later state, changed with the rows computed beside it: --batch-invariant and a
// verification's drafted rows need it to depend on the row alone.
at::Tensor dt_softplus(const at::Tensor& dt, const at::Tensor& dt_bias) {
  const int64_t h = dt_bias.numel();
  if (h > kMaxHeads || dt.numel() % std::max<int64_t>(h, 1) != 0) {
    return at::softplus(dt.to(at::kFloat) + dt_bias.to(at::kFloat));
  }
  auto x = dt.to(at::kFloat).contiguous();
  auto bias = dt_bias.to(at::kFloat).contiguous();
  auto out = at::empty_like(x);
  const float *x_p = x.data_ptr<float>(), *bias_p = bias.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  alignas(64) float b[kMaxHeads], v[kMaxHeads], e[kMaxHeads];
  std::memcpy(b, bias_p, h * sizeof(float));
  for (int64_t r = 0, rows = x.numel() / std::max<int64_t>(h, 1); r < rows; ++r) {
    std::memcpy(v, x_p + r * h, h * sizeof(float));
    for (int64_t i = 0; i < h; ++i) v[i] += b[i];
    // ATen's threshold (20): above it softplus(v) is v; the exp is clamped so that no lane
    // of a vector computes an infinity the -ffast-math build assumes away
    for (int64_t i = 0; i < h; ++i) e[i] = std::log1p(std::exp(std::min(v[i], 20.0f)));
    for (int64_t i = 0; i < h; ++i) v[i] = v[i] > 20.0f ? v[i] : e[i];
    std::memcpy(out_p + r * h, v, h * sizeof(float));
  }
  return out;
}

SsmInputs ssm_inputs(const at::Tensor& xbc, const at::Tensor& dt, const StepMamba2& m) {
  const int64_t gn = m.n_groups * m.d_state;
  auto parts = xbc.to(at::kFloat).split_with_sizes({m.d_inner, gn, gn}, -1);
  auto b = parts[1].unflatten(-1, {m.n_groups, m.d_state});
  auto c = parts[2].unflatten(-1, {m.n_groups, m.d_state});
  auto d = dt_softplus(dt, m.dt_bias);
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

constexpr int64_t kMaxState = 256;  // d_state of the fused decode recurrence (Falcon-H1's 256)
constexpr int64_t kByRows = 16;     // rows up to which a chunk steps row by row (by_rows)

// The decode rows' state update in place, one pass over each slot's [H, P, N] state: per
// (row, head) the decay exp(dt a) once, then per head row p: s = decay s + (dt x_p) B, y_p =
// s . C + D x_p (mamba2.py _step's math). The state row, B and C are worked on in local
// 64-byte-aligned copies, so that GCC's vectorization of the loops (the reduction for y) takes
// the same path on every call whatever the tensors' addresses (mamba.cpp channel_row's NOTE).
// Against the ATen ops it replaces (mul_, baddbmm_, vecdot over the states, plus a gather and a
// scatter where the slots are not one run) it reads and writes each state once: Falcon-H1-0.5B's
// shape, 32 decode rows, one layer (25 MB of states), Xeon: docs/performance.md.
at::Tensor fused_ssm_step(const SsmInputs& in, at::Tensor& ssm, const int64_t* slot_p,
                          const StepMamba2& m) {
  const int64_t n_seq = in.x.size(0), h = m.n_heads, p = m.head_dim, n = m.d_state;
  const int64_t g = m.n_groups, hg = h / g;
  auto x = in.x.contiguous(), dt = in.dt.contiguous(), b = in.b.contiguous();
  auto c = in.c.contiguous();
  auto a = m.a.to(at::kFloat).contiguous(), skip = m.d.to(at::kFloat).contiguous();
  auto y = at::empty({n_seq, h, p}, x.options());
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>();
  const float *b_p = b.data_ptr<float>(), *c_p = c.data_ptr<float>();
  const float *a_p = a.data_ptr<float>(), *d_p = skip.data_ptr<float>();
  float *s_p = ssm.data_ptr<float>(), *y_p = y.data_ptr<float>();
  at::parallel_for(0, n_seq * h, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float bl[kMaxState], cl[kMaxState], st[kMaxState];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t q = i / h, head = i % h, grp = head / hg;
      const float step_dt = dt_p[i], decay = std::exp(step_dt * a_p[head]);
      std::memcpy(bl, b_p + (q * g + grp) * n, n * sizeof(float));
      std::memcpy(cl, c_p + (q * g + grp) * n, n * sizeof(float));
      const float* xs = x_p + i * p;
      float* rows = s_p + (slot_p[q] * h + head) * p * n;
      for (int64_t r = 0; r < p; ++r) {
        std::memcpy(st, rows + r * n, n * sizeof(float));
        const float xdt = step_dt * xs[r];
        float acc = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
          st[k] = st[k] * decay + xdt * bl[k];
          acc += st[k] * cl[k];
        }
        std::memcpy(rows + r * n, st, n * sizeof(float));
        y_p[i * p + r] = acc + d_p[head] * xs[r];
      }
    }
  });
  return y;
}

// decode rows: one token per sequence, their slots' states move one step (mamba2.py _step): the
// conv by conv_out, the SSM fused in place (fused_ssm_step) where d_state <= kMaxState (and the
// states are contiguous), else ATen
at::Tensor step(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv, at::Tensor& ssm,
                const at::Tensor& slots, int64_t run_lo, int64_t run_hi, const StepMamba2& m) {
  auto window = at::cat({conv.index_select(0, slots), xbc.to(conv.scalar_type()).unsqueeze(2)}, 2);
  conv.index_copy_(0, slots, window.index({Slice(), Slice(), Slice(1, at::indexing::None)}));
  auto in = ssm_inputs(conv_out(window, m), dt, m);
  if (m.d_state <= kMaxState && ssm.is_contiguous()) {
    // one row a slot, each slot once: fused_ssm_step writes the slots' states from several
    // threads in place
    auto slot_of = slots.to(at::kLong).contiguous();
    const int64_t* slot_p = slot_of.data_ptr<int64_t>();
    TORCH_CHECK(slot_of.dim() == 1 && slot_of.numel() == xbc.size(0),
                "mamba2_mix: one decode slot for each decode row");
    std::vector<bool> seen(static_cast<size_t>(ssm.size(0)), false);
    for (int64_t q = 0; q < slot_of.numel(); ++q) {
      const int64_t s = slot_p[q];
      TORCH_CHECK(0 <= s && s < ssm.size(0) && !seen[s],
                  "mamba2_mix: decode slots distinct and in range");
      seen[s] = true;
    }
    return fused_ssm_step(in, ssm, slot_p, m);
  }
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

// Whether a chunk of n rows with n_caps captures runs the recurrence row by row (mamba2.py
// BY_ROWS): short chunks, and chunks cut at most rows (speculative decoding's verification)
bool by_rows(int64_t n, int64_t n_caps) { return n <= kByRows || 2 * n_caps >= n; }

// a prompt chunk from its slot's state, split at its captures (mamba2.py _scan)
at::Tensor scan(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv, at::Tensor& ssm,
                int64_t slot, const std::vector<std::pair<int64_t, int64_t>>& captures,
                const StepMamba2& m) {
  const int64_t k1 = m.d_conv - 1, n = xbc.size(0);
  auto raw = at::cat({conv[slot], xbc.to(conv.scalar_type()).t()}, 1);
  if (by_rows(n, static_cast<int64_t>(captures.size())) && m.d_state <= kMaxState &&
      ssm.is_contiguous()) {
    // the decode rows' math a row at a time (their conv_out over each row's window, the
    // recurrence in place in the slot), each capture copied out when its row is reached: a
    // pass over the state per row, against ssd_scan's ~20 ops per segment (a verification
    // step captures before every drafted row: 1-row segments), and a row's bits are a decoded
    // row's (speculative decoding's drafted rows, --batch-invariant)
    auto in = ssm_inputs(conv_out(raw.unfold(1, m.d_conv, 1).transpose(0, 1), m), dt, m);
    auto cuts = captures;
    std::sort(cuts.begin(), cuts.end());
    size_t next_cut = 0;
    std::vector<at::Tensor> ys;
    for (int64_t r = 0; r <= n; ++r) {
      for (; next_cut < cuts.size() && cuts[next_cut].first == r; ++next_cut) {
        const int64_t to = cuts[next_cut].second;
        conv[to].copy_(raw.index({Slice(), Slice(r, r + k1)}));
        ssm[to].copy_(ssm[slot]);
      }
      if (r == n) break;
      SsmInputs row{in.x.narrow(0, r, 1), in.b.narrow(0, r, 1), in.c.narrow(0, r, 1),
                    in.dt.narrow(0, r, 1)};
      ys.push_back(fused_ssm_step(row, ssm, &slot, m));  // the D skip included
    }
    conv[slot].copy_(raw.index({Slice(), Slice(n, n + k1)}));
    return at::cat(ys);
  }
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

// mamba_mix: the Mamba (1) mixer between its two linears (model/layers/mamba.py's MambaMixer,
// whose torch ops it follows one for one): the depthwise causal conv over the conv state, dt /
// B / C from x_proj (RMS-normed where the model says: Falcon-Mamba, Jamba) and dt_proj, the
// selective scan over the ssm state (one recurrence step per decode row; a prompt chunk row
// after row, channel by channel, copied into its captures' slots), the D skip and the SiLU gate. The Python layers call it
// where the kernels are loaded and step_layers calls it in the one-call step, so both give the
// same bits; without the kernels the Python torch ops are the float32 reference (the same math:
// the scans here are fused loops, see step and scan).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using at::indexing::None;
using at::indexing::Slice;

at::Tensor rms(const at::Tensor& t, const std::optional<at::Tensor>& w, double eps) {
  auto r = t * at::rsqrt(t.pow(2).mean(-1, true) + eps);
  return w ? r * *w : r;
}

struct SsmInputs {
  at::Tensor dt, b, c;  // [L, d_inner] (softplus'd), [L, N], [L, N]: float32
};

SsmInputs ssm_inputs(const at::Tensor& xc, const StepMamba& m) {
  auto parts = at::linear(xc, m.x_w).split_with_sizes({m.dt_rank, m.d_state, m.d_state}, -1);
  at::Tensor dt = parts[0], b = parts[1], c = parts[2];
  if (m.norm) {
    dt = rms(dt, m.dt_norm, m.eps);
    b = rms(b, m.b_norm, m.eps);
    c = rms(c, m.c_norm, m.eps);
  }
  return {at::softplus(at::linear(dt, m.dt_w, m.dt_b)), b, c};
}

constexpr int64_t kMaxState = 256;  // d_state of the fused decode recurrence (Mamba's: 16)

// One row of one channel's recurrence (mamba.py's math for one (row, channel)): e = exp(dt a),
// s = e s + dt x B, returns s . C; `s` is the caller's local state row. Every array the loops
// touch but a_row (read elementwise) is local and 64-byte aligned, so GCC's vectorization of
// them (libmvec's expf, the reduction for y) takes the same path on every call: no alias or
// alignment check that an address could flip (moe_route's lesson, step.cpp), so a row's bits
// never depend on where its tensors lie.
float channel_row(const float* a_row, float* s, const float* b_row, const float* c_row, float dt,
                  float x, int64_t n) {
  alignas(64) float e[kMaxState], b[kMaxState], c[kMaxState];
  std::memcpy(b, b_row, n * sizeof(float));
  std::memcpy(c, c_row, n * sizeof(float));
  for (int64_t i = 0; i < n; ++i) e[i] = dt * a_row[i];
  for (int64_t i = 0; i < n; ++i) e[i] = std::exp(e[i]);
  const float xdt = dt * x;
  float y = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = e[i] * s[i] + xdt * b[i];
    y += s[i] * c[i];
  }
  return y;
}

// The decode rows' causal conv before its SiLU, in float32: each (sequence, channel) reads its
// slot's last K - 1 inputs and the new one (oldest first) against conv_w's row, adds the bias,
// and shifts the new input into the state, in place. T: the conv state's dtype (the model's).
template <typename T>
at::Tensor conv_step(const at::Tensor& x, at::Tensor& conv, const int64_t* slot_p,
                     const StepMamba& m) {
  const int64_t n_seq = x.size(0), d = m.d_inner, k = m.d_conv;
  auto xs = x.to(conv.scalar_type()).contiguous();
  auto out = at::empty({n_seq, d}, x.options().dtype(at::kFloat));
  const T *x_p = xs.data_ptr<T>(), *w_p = m.conv_w.data_ptr<T>();
  const T* b_p = m.conv_b ? m.conv_b->data_ptr<T>() : nullptr;
  T* c_p = conv.data_ptr<T>();
  float* o_p = out.data_ptr<float>();
  at::parallel_for(0, n_seq * d, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t q = i / d, ch = i % d;
      T* st = c_p + (slot_p[q] * d + ch) * (k - 1);
      const T* w = w_p + ch * k;
      float acc = 0.0f;
      for (int64_t j = 0; j < k - 1; ++j) acc += static_cast<float>(st[j]) * static_cast<float>(w[j]);
      acc += static_cast<float>(x_p[i]) * static_cast<float>(w[k - 1]);
      o_p[i] = b_p ? acc + static_cast<float>(b_p[ch]) : acc;
      for (int64_t j = 0; j + 1 < k - 1; ++j) st[j] = st[j + 1];
      st[k - 2] = x_p[i];
    }
  });
  return out;
}

// decode rows: one token per sequence, their slots' states move one step (mamba.py _step): the
// conv (conv_step, then ATen's SiLU) and the state update with S . C (channel_row) in one pass
// over each slot's states in place, channels split over the threads; dt / B / C in ATen.
// NOTE: the same math as the torch ops, not their rounding (float32 conv sums, exp, op order):
// the torch path (no kernels) is the reference within rounding. Measured (Mamba-130M shape,
// Q4_K_M re-quantized to int4, bfloat16, 2-core Xeon): docs/performance.md.
at::Tensor step(const at::Tensor& x, at::Tensor& conv, at::Tensor& ssm, const at::Tensor& slots,
                const StepMamba& m) {
  auto slot_of = slots.to(at::kLong).contiguous();
  const int64_t* slot_p = slot_of.data_ptr<int64_t>();
  // one row a slot, each slot once: the loops below write the slots' states from several
  // threads in place
  TORCH_CHECK(slot_of.dim() == 1 && slot_of.numel() == x.size(0),
              "mamba_mix: one decode slot for each decode row");
  std::vector<bool> seen(static_cast<size_t>(conv.size(0)), false);
  for (int64_t q = 0; q < slot_of.numel(); ++q) {
    const int64_t s = slot_p[q];
    TORCH_CHECK(0 <= s && s < conv.size(0) && !seen[s], "mamba_mix: decode slots distinct and "
                "in range");
    seen[s] = true;
  }
  at::Tensor pre;
  if (conv.scalar_type() == at::kBFloat16) {
    pre = conv_step<at::BFloat16>(x, conv, slot_p, m);
  } else {
    pre = conv_step<float>(x, conv, slot_p, m);
  }
  auto xc = at::silu(pre);
  auto in = ssm_inputs(xc, m);
  const int64_t n_seq = xc.size(0), d = m.d_inner, n = m.d_state;
  auto dt = in.dt.contiguous(), b = in.b.contiguous(), c = in.c.contiguous();
  auto y = at::empty({n_seq, d}, xc.options());
  const float *dt_p = dt.data_ptr<float>(), *x_p = xc.data_ptr<float>();
  const float *b_p = b.data_ptr<float>(), *c_p = c.data_ptr<float>();
  const float *a_p = m.a.data_ptr<float>(), *skip = m.d.data_ptr<float>();
  float *s_p = ssm.data_ptr<float>(), *y_p = y.data_ptr<float>();
  at::parallel_for(0, n_seq * d, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t q = i / d, ch = i % d;
      float* s_row = s_p + (slot_p[q] * d + ch) * n;
      alignas(64) float st[kMaxState];
      std::memcpy(st, s_row, n * sizeof(float));
      const float v = channel_row(a_p + ch * n, st, b_p + q * n, c_p + q * n, dt_p[i], x_p[i], n);
      std::memcpy(s_row, st, n * sizeof(float));
      y_p[i] = v + skip[ch] * x_p[i];
    }
  });
  return y;
}

// a prompt chunk from its slot's state, split at its captures (mamba.py _scan): the conv and
// dt / B / C in ATen; the scan channel by channel (split over the threads), each channel's state
// kept in a local row over all the chunk's rows (read and written once, not once a row), and
// copied into a capture's slot once the capture's rows are consumed. NOTE: the same math as
// the torch row loop, not its rounding (exp, op order): the torch path is the reference.
at::Tensor scan(const at::Tensor& x, at::Tensor& conv, at::Tensor& ssm, int64_t slot,
                const std::vector<std::pair<int64_t, int64_t>>& captures, const StepMamba& m) {
  const int64_t k1 = m.d_conv - 1, rows = x.size(0), d = m.d_inner, n = m.d_state;
  auto raw = at::cat({conv[slot], x.to(conv.scalar_type()).t()}, 1);  // [d_inner, K-1 + L]
  const int64_t one = 1, zero = 0;
  auto out = at::conv1d(raw.unsqueeze(0), m.conv_w.unsqueeze(1), m.conv_b, at::IntArrayRef(one),
                        at::IntArrayRef(zero), at::IntArrayRef(one), raw.size(0));
  auto xc = at::silu(out[0]).t().to(at::kFloat).contiguous();
  auto in = ssm_inputs(xc, m);
  auto dt = in.dt.contiguous(), b = in.b.contiguous(), c = in.c.contiguous();
  int64_t last = 1;
  for (const auto& [r, to] : captures) {
    TORCH_CHECK(last <= r && r <= rows && 0 <= to && to < ssm.size(0),
                "mamba_mix: captures after 1..rows rows, ascending, into slots in range");
    conv[to].copy_(raw.index({Slice(), Slice(r, r + k1)}));  // the last K-1 raw rows at r
    last = r;
  }
  conv[slot].copy_(raw.index({Slice(), Slice(rows, rows + k1)}));
  auto y = at::empty({rows, d}, xc.options());
  const float *dt_p = dt.data_ptr<float>(), *x_p = xc.data_ptr<float>();
  const float *b_p = b.data_ptr<float>(), *c_p = c.data_ptr<float>();
  const float *a_p = m.a.data_ptr<float>(), *skip = m.d.data_ptr<float>();
  float *s_p = ssm.data_ptr<float>(), *y_p = y.data_ptr<float>();
  const int64_t slot_stride = d * n;
  at::parallel_for(0, d, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float st[kMaxState];
    for (int64_t ch = begin; ch < end; ++ch) {
      std::memcpy(st, s_p + slot * slot_stride + ch * n, n * sizeof(float));
      size_t next = 0;  // captures ascend by row
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t i = t * d + ch;
        const float v = channel_row(a_p + ch * n, st, b_p + t * n, c_p + t * n, dt_p[i],
                                    x_p[i], n);
        y_p[i] = v + skip[ch] * x_p[i];
        for (; next < captures.size() && captures[next].first == t + 1; ++next) {
          std::memcpy(s_p + captures[next].second * slot_stride + ch * n, st, n * sizeof(float));
        }
      }
      std::memcpy(s_p + slot * slot_stride + ch * n, st, n * sizeof(float));
    }
  });
  return y;
}

}  // namespace

at::Tensor mamba_mix(const at::Tensor& xz, at::Tensor conv, at::Tensor ssm, const StepMamba& m,
                     const StepState& state) {
  const int64_t n = xz.size(0), d = m.d_inner;
  const auto f32 = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat; };
  TORCH_CHECK(xz.dim() == 2 && xz.size(1) >= 2 * d, "mamba_mix: xz [n, >= 2 d_inner]");
  TORCH_CHECK(conv.dim() == 3 && conv.size(1) == d && conv.size(2) == m.d_conv - 1 &&
                  ssm.dim() == 3 && f32(ssm) && ssm.size(0) == conv.size(0) &&
                  ssm.size(1) == d && ssm.size(2) == m.d_state,
              "mamba_mix: conv [n_slots, d_inner, d_conv - 1] and float32 ssm [n_slots, d_inner, "
              "d_state] must match the mixer's sizes");
  TORCH_CHECK(ssm.is_contiguous() && conv.is_contiguous() && m.a.is_contiguous() &&
                  m.d.is_contiguous() && m.conv_w.is_contiguous() &&
                  m.conv_w.scalar_type() == conv.scalar_type() &&
                  (!m.conv_b || (m.conv_b->is_contiguous() &&
                                 m.conv_b->scalar_type() == conv.scalar_type())) &&
                  (conv.scalar_type() == at::kFloat || conv.scalar_type() == at::kBFloat16) &&
                  m.d_conv >= 2 && m.d_state <= kMaxState,
              "mamba_mix: contiguous states, a, d and conv weights in the conv state's dtype "
              "(float32 or bfloat16), d_conv >= 2, d_state <= 256");
  TORCH_CHECK(f32(m.x_w) && m.x_w.dim() == 2 && m.x_w.size(0) == m.dt_rank + 2 * m.d_state &&
                  m.x_w.size(1) == d && f32(m.dt_w) && m.dt_w.dim() == 2 &&
                  m.dt_w.size(0) == d && m.dt_w.size(1) == m.dt_rank && f32(m.dt_b) &&
                  f32(m.a) && m.a.dim() == 2 && m.a.size(0) == d && m.a.size(1) == m.d_state &&
                  f32(m.d) && m.d.numel() == d,
              "mamba_mix: float32 x_w [dt_rank + 2 N, d_inner], dt_w [d_inner, dt_rank], dt_b, "
              "a [d_inner, N] and d [d_inner]");
  check_state(state, n, conv.size(0), "mamba_mix");
  auto parts = xz.index({Slice(), Slice(0, 2 * d)}).split(d, -1);
  const at::Tensor &x = parts[0], &z = parts[1];
  auto y = at::zeros({n, d}, xz.options().dtype(at::kFloat));
  const int64_t n_dec = state.decode_slots.defined() ? state.decode_slots.numel() : 0;
  if (n_dec) {
    const bool all_rows = !state.decode_rows.defined() || state.decode_rows.numel() == 0;
    if (all_rows) {  // the first n_dec rows (check_state), as short_conv reads them
      auto part = step(x.narrow(0, 0, n_dec), conv, ssm, state.decode_slots, m);
      if (n_dec == n) {
        y = part;
      } else {
        y.narrow(0, 0, n_dec).copy_(part);
      }
    } else {
      const auto& rows = state.decode_rows;
      y.index_copy_(0, rows, step(x.index_select(0, rows), conv, ssm, state.decode_slots, m));
    }
  }
  const int64_t n_prompt = static_cast<int64_t>(state.prompt_slots.size());
  for (int64_t p = 0; p < n_prompt; ++p) {
    const auto caps = captures_of(state, p);
    const auto rows = Slice(state.prompt_bounds[2 * p], state.prompt_bounds[2 * p + 1]);
    y.index_put_({rows}, scan(x.index({rows}), conv, ssm, state.prompt_slots[p], caps, m));
  }
  return (y * at::silu(z.to(at::kFloat))).to(xz.scalar_type());
}

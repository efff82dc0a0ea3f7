// CPU kernels for the rest of a layer: RMSNorm, SiLU-mul, RoPE (built by model/kernels/__init__.py
// with the other sources into one extension; the Python bindings are bindings.cpp's).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// rms_norm_bf16 / silu_mul_bf16: what model/layers/blocks.py's RMSNorm and FeedForward compute for
// bfloat16 rows, rounded to bfloat16 where torch rounds, in one pass each instead of ~10 ATen
// ops (RMSNorm of [32, 576]: 4.3 vs 24.7 us). The float32 math inside differs from torch's in
// op order (-ffast-math, vector expf), so a value can differ by one bfloat16 step, rarely. Both
// paths call these, so the one-call decode step stays bit-identical to the Python layers.
//
// x [n, d] -> bf16(x * rsqrt(mean(x^2) + eps) * w) in float32, rounded once as torch 2.13.
// Into `out` (x's shape, contiguous): step_layers reuses one buffer across layers; NOINLINE,
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
// model/layers/decoder.py's cat + mul + addcmul (3 ATen ops, 2 allocations). x [n, heads, hd] (any row
// and head strides, dims contiguous), c, s [n, 1, hd] (kvcache.rope.rope_tables) in x's
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

// hadamard_: the orthonormal Walsh-Hadamard transform H_n (Sylvester's order, scaled by
// 1/sqrt(n), so H_n is its own inverse) of each run of n values of every head of x [rows, heads,
// hd] (any row and head strides, dims contiguous; n a power of two dividing hd), in place, in
// float32, rounded once to x's dtype. A quantized K/V cache stores H k and H v (kvcache/
// rotation.py): q . k = (H q) . (H k), and an outlier's energy spreads over its block's values
// before they share one scale. Both the Python layers and step_layers call it (NOINLINE).
// One run of n values: log2(n) passes of the constant-geometry form (llama.cpp builds H as a
// matrix; this is the transform in n log n adds), out[i] = in[2i] + in[2i + 1], out[i + n/2] =
// in[2i] - in[2i + 1], which gives Sylvester's order; every pass reads and writes whole runs
// (the compiler vectorizes the stride-2 reads), where the in-place butterflies' first passes
// (partners 1, 2, 4 apart) do not. The result lands in `a` or `b` (returned).
float* hadamard_run(float* __restrict a, float* __restrict b, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t len = 1; len < n; len *= 2) {
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = a[2 * i], x1 = a[2 * i + 1];
      b[i] = x0 + x1;
      b[i + half] = x0 - x1;
    }
    std::swap(a, b);
  }
  return a;
}

template <typename T>
void hadamard_rows(T* xp, int64_t rows, int64_t heads, int64_t hd, int64_t xs0, int64_t xs1,
                   int64_t n) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(n));
  auto transform = [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(2 * hd);
    float *a = buf.data(), *b = a + hd;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        T* x = xp + r * xs0 + h * xs1;
        for (int64_t d = 0; d < hd; ++d) a[d] = to_float(x[d]);
        for (int64_t c = 0; c < hd; c += n) {
          const float* v = hadamard_run(a + c, b + c, n);
          for (int64_t d = 0; d < n; ++d) x[c + d] = T(v[d] * scale);
        }
      }
    }
  };
  if (rows * heads * hd < 32768) return transform(0, rows);  // a decode step's rows: one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / (heads * hd)), transform);
}

__attribute__((noinline)) at::Tensor hadamard_(at::Tensor x, int64_t n) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1,
              "hadamard_ takes x [rows, heads, head_dim] with contiguous head_dim");
  const int64_t rows = x.size(0), heads = x.size(1), hd = x.size(2);
  TORCH_CHECK(n >= 1 && (n & (n - 1)) == 0 && hd % n == 0,
              "hadamard_: n must be a power of two dividing head_dim");
  if (x.scalar_type() == at::kBFloat16) {
    hadamard_rows(x.data_ptr<at::BFloat16>(), rows, heads, hd, x.stride(0), x.stride(1), n);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "hadamard_ takes bfloat16 or float32");
    hadamard_rows(x.data_ptr<float>(), rows, heads, hd, x.stride(0), x.stride(1), n);
  }
  return x;
}

// rms_norm_f32 / silu_mul_f32: the float32 twins (no rounding; -ffast-math sums, so a value
// can differ from F.rms_norm's in the last bits). RMSNorm of [1, 576] as ~6 ATen ops cost ~24 us.
// Into `out` (x's shape, contiguous): step_layers reuses one buffer across layers; NOINLINE,
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

// The fused RMSNorm and SiLU-mul for the activation dtype: what model/layers/blocks.py calls through
// ForwardBatch.fused, and step_layers (step.cpp), so that both paths compute the same values.
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

// short_conv (kernels.h): one window of L values of v per row, a float32 sum in window order
namespace {
template <typename T>
void short_conv_t(const at::Tensor& v, at::Tensor& conv, const at::Tensor& wf,
                  const StepState& st, at::Tensor& out) {
  const int64_t d = v.size(1), k1 = conv.size(2), L = k1 + 1;
  const T* vp = v.data_ptr<T>();
  T* cp = conv.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* wp = wf.data_ptr<float>();
  // rows of one sequence in order from its slot's state; row r of them at batch row rows[r]
  auto scan = [&](int64_t slot, const int64_t* rows, int64_t first, int64_t count,
                  const std::vector<std::pair<int64_t, int64_t>>& caps) {
    at::parallel_for(0, d, 64, [&](int64_t c0, int64_t c1) {
      float win[64];
      for (int64_t c = c0; c < c1; ++c) {
        T* state = cp + (slot * d + c) * k1;
        for (int64_t j = 0; j < k1; ++j) win[j] = static_cast<float>(state[j]);
        const float* w = wp + c * L;
        size_t cap = 0;
        for (int64_t r = 0; r < count; ++r) {
          const int64_t row = rows != nullptr ? rows[r] : first + r;
          win[k1] = static_cast<float>(vp[row * d + c]);
          float acc = 0.0f;
          for (int64_t j = 0; j < L; ++j) acc += win[j] * w[j];
          op[row * d + c] = static_cast<T>(acc);
          for (int64_t j = 0; j < k1; ++j) win[j] = win[j + 1];  // exact: v's values in T
          for (; cap < caps.size() && caps[cap].first == r + 1; ++cap)
            for (int64_t j = 0; j < k1; ++j)
              cp[(caps[cap].second * d + c) * k1 + j] = static_cast<T>(win[j]);
        }
        for (int64_t j = 0; j < k1; ++j) state[j] = static_cast<T>(win[j]);
      }
    });
  };
  const int64_t n_dec = st.decode_slots.defined() ? st.decode_slots.numel() : 0;
  const bool all_rows = !st.decode_rows.defined() || st.decode_rows.numel() == 0;
  const int64_t* slots = n_dec ? st.decode_slots.data_ptr<int64_t>() : nullptr;
  const int64_t* drows = all_rows ? nullptr : st.decode_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_dec; ++i) {  // one step each (distinct slots)
    const int64_t row = drows != nullptr ? drows[i] : i;
    scan(slots[i], nullptr, row, 1, {});
  }
  const int64_t n_prompt = static_cast<int64_t>(st.prompt_slots.size());
  for (int64_t p = 0; p < n_prompt; ++p) {
    const int64_t start = st.prompt_bounds[2 * p], end = st.prompt_bounds[2 * p + 1];
    scan(st.prompt_slots[p], nullptr, start, end - start, captures_of(st, p));
  }
}
}  // namespace

void check_state(const StepState& state, int64_t n, int64_t n_slots, const char* who) {
  const int64_t n_dec = state.decode_slots.defined() ? state.decode_slots.numel() : 0;
  const bool all_rows = !state.decode_rows.defined() || state.decode_rows.numel() == 0;
  auto in_slots = [n_slots](int64_t s) { return 0 <= s && s < n_slots; };
  if (n_dec) {
    TORCH_CHECK(state.decode_slots.scalar_type() == at::kLong &&
                    state.decode_slots.is_contiguous(),
                who, ": decode_slots must be contiguous int64");
    const int64_t* sp = state.decode_slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < n_dec; ++i)
      TORCH_CHECK(in_slots(sp[i]), who, ": decode slot ", sp[i], " is not in [0, ", n_slots, ")");
    if (all_rows) {
      TORCH_CHECK(n_dec <= n, who, ": more decode slots than rows");
    } else {
      TORCH_CHECK(state.decode_rows.scalar_type() == at::kLong &&
                      state.decode_rows.is_contiguous() && state.decode_rows.numel() == n_dec,
                  who, ": decode_rows must be contiguous int64, one per slot");
      const int64_t* rp = state.decode_rows.data_ptr<int64_t>();
      for (int64_t i = 0; i < n_dec; ++i)
        TORCH_CHECK(0 <= rp[i] && rp[i] < n, who, ": decode row ", rp[i], " is not in [0, ", n,
                    ")");
    }
    if (state.decode_run_lo >= 0) {
      TORCH_CHECK(state.decode_run_hi - state.decode_run_lo == n_dec &&
                      state.decode_run_hi <= n_slots,
                  who, ": decode_run is not a range of the decode slots");
      for (int64_t i = 0; i < n_dec; ++i)
        TORCH_CHECK(sp[i] == state.decode_run_lo + i, who, ": decode_run is not the decode slots");
    }
  }
  const int64_t n_prompt = static_cast<int64_t>(state.prompt_slots.size());
  TORCH_CHECK(static_cast<int64_t>(state.prompt_bounds.size()) == 2 * n_prompt &&
                  state.captures.size() % 3 == 0,
              who, ": one bounds pair and one slot per prompt chunk; captures in threes");
  for (int64_t p = 0; p < n_prompt; ++p) {
    const int64_t start = state.prompt_bounds[2 * p], end = state.prompt_bounds[2 * p + 1];
    TORCH_CHECK(0 <= start && start < end && end <= n && in_slots(state.prompt_slots[p]), who,
                ": prompt chunk ", p, " is not a range of the ", n, " rows with a slot");
  }
  for (size_t i = 0; i < state.captures.size(); i += 3) {
    const int64_t p = state.captures[i], r = state.captures[i + 1];
    TORCH_CHECK(0 <= p && p < n_prompt && in_slots(state.captures[i + 2]) && 0 < r &&
                    r <= state.prompt_bounds[2 * p + 1] - state.prompt_bounds[2 * p] &&
                    (i == 0 || state.captures[i - 3] != p || state.captures[i - 2] <= r),
                who, ": capture ", i / 3, " is not (chunk, 0 < r <= its rows, slot) in "
                "ascending r");
  }
}

at::Tensor short_conv(const at::Tensor& v, at::Tensor conv, const at::Tensor& weight,
                      const StepState& state) {
  TORCH_CHECK(v.dim() == 2 && conv.dim() == 3 && weight.dim() == 2, "short_conv: v [n, d], "
              "conv [n_slots, d, L - 1], weight [d, L]");
  const int64_t n = v.size(0), d = v.size(1), k1 = conv.size(2);
  TORCH_CHECK(conv.size(1) == d && weight.size(0) == d && weight.size(1) == k1 + 1 &&
                  k1 >= 1 && k1 < 64,
              "short_conv: conv [n_slots, d, L - 1] and weight [d, L] must match v's d, L <= 64");
  TORCH_CHECK(conv.is_contiguous() && conv.scalar_type() == v.scalar_type() &&
                  (v.scalar_type() == at::kFloat || v.scalar_type() == at::kBFloat16),
              "short_conv: a contiguous state in v's dtype, bfloat16 or float32");
  check_state(state, n, conv.size(0), "short_conv");
  auto vc = v.contiguous();
  auto wf = weight.to(at::kFloat).contiguous();
  auto out = at::zeros_like(vc);
  if (v.scalar_type() == at::kFloat)
    short_conv_t<float>(vc, conv, wf, state, out);
  else
    short_conv_t<at::BFloat16>(vc, conv, wf, state, out);
  return out;
}

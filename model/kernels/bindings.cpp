// The Python module of a build: every kernel's binding, the argument structs of quant_linear and
// step_layers built field by field from Python, and what the build was compiled for. The kernels
// themselves are in the other files (kernels.h declares them).

#include "kernels.h"

#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// The compute kernels run without the GIL (they touch no Python object; arguments are
// converted before and the result after): the engine thread's C++ step then overlaps the HTTP
// thread's work (streaming the previous step's tokens, reading new requests), and a second
// model's engine in router mode computes beside it instead of waiting for the interpreter.
// Their scratch buffers are thread_local, so concurrent callers never share one.
constexpr auto kNoGil = py::call_guard<py::gil_scoped_release>();

// The one-call step is the exception: a step of at most gil_rows rows keeps the GIL (the caller
// sizes it by the model's work per row: model/runner/native.py step_gil_rows; the decode step of
// up to 64 streams on a 1.5B, 30-250 ms on 2 cores). Where every core computes, the event
// loop's work for the previous step (a chunk per stream) costs less between two steps than
// beside one, where it preempts a thread the step waits for: 16 streams on the 1.5B, 2-core
// Zen 4, gave 1-5% fewer tokens/s with it beside (4 alternating pairs). A prompt chunk or a
// bigger batch (seconds) lets the loop run: /health and the streams never wait on it.
at::Tensor step_layers_py(at::Tensor x, const std::vector<StepLayer>& layers,
                          const std::vector<StepGroups>& groups,
                          const std::vector<at::Tensor>& rope_tables, int64_t n_heads, double eps,
                          double scale, int64_t group_size, int64_t gil_rows,
                          const std::optional<StepState>& state) {
  std::optional<py::gil_scoped_release> nogil;
  if (x.dim() > 0 && x.size(0) > gil_rows) nogil.emplace();
  return step_layers(std::move(x), layers, groups, rope_tables, n_heads, eps, scale, group_size,
                     state ? *state : StepState{});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, kNoGil, "decode attention over cells, in place",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cells"), py::arg("lens"),
        py::arg("scale"), py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("prompt_attention", &prompt_attention, kNoGil, "a prompt chunk's attention over cells",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cells"), py::arg("lens"),
        py::arg("scale"), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::arg("firsts") = py::none());
  m.def("has_bf16_kernels", &has_bf16_kernels, "whether the AVX-512 BF16 kernels are built");
  m.def("has_attention_sinks", &has_attention_sinks,
        "whether decode_attention and prompt_attention take sinks (gpt-oss)");
  m.def("reads_cache_types", &reads_cache_types,
        "whether the attention kernels and step_layers read and write every cache type");
  m.def("dequant_cells", &dequant_cells, kNoGil, "cells of a K/V cache layer, dequantized");
  m.def("has_f32_kernels", &has_f32_kernels, "whether prompt_attention takes float32 (AVX2)");
  m.def("compiled_isa", &compiled_isa, "the instruction-set extensions this build was compiled for");
  m.def("rms_norm_bf16", &rms_norm_bf16, kNoGil,
        "RMSNorm of bfloat16 rows, rounded as torch rounds");
  m.def("silu_mul_bf16", &silu_mul_bf16, kNoGil, "silu(gate) * up of bfloat16 rows");
  m.def("rms_norm_f32", &rms_norm_f32, kNoGil, "RMSNorm of float32 rows in one pass");
  m.def("silu_mul_f32", &silu_mul_f32, kNoGil, "silu(gate) * up of float32 rows");
  m.def("rms_norm", &rms_norm_of, kNoGil, "RMSNorm of bfloat16 or float32 rows, in one pass");
  m.def("moe_route", &moe_route, kNoGil, py::arg("logits"), py::arg("k"), py::arg("norm_topk"),
        py::arg("sigmoid"), py::arg("selection_bias"), py::arg("scale"),
        "a mixture of experts' routing: (weights [n, k] float32, experts [n, k] int64)");
  m.def("silu_mul", &silu_mul_of, kNoGil,
        "silu(gate) * up of bfloat16 or float32 rows, in one pass");
  m.def("rope_neox_", &rope_neox_, kNoGil, "rotate-half RoPE of [n, heads, head_dim] in place");
  m.def("hadamard_", &hadamard_, kNoGil, py::arg("x"), py::arg("n"),
        "the orthonormal Walsh-Hadamard transform of each n values of [rows, heads, head_dim]");
  m.def("int4_mm", &int4_mm, kNoGil, "float32 rows times cellserve-layout int4 weights, in int8");
  m.def("int4_gemm", &int4_gemm, kNoGil,
        "float32 batches times int4 weights (pack_int4_gemm), in int8");
  m.def("int8_mm", &int8_mm, kNoGil,
        "float32 rows times int8 weights with a scale per 32, in int8");
  m.def("quant_linear", &quant_linear, kNoGil, py::arg("x"), py::arg("w"), py::arg("group_size"),
        "rows times a quantized linear (a StepLinear), by its kind and the row count");
  m.def("ggml_linear", &ggml_linear, kNoGil, py::arg("x"), py::arg("parts"), py::arg("types"),
        py::arg("k"), "rows times a GGUF's own quantized blocks (parts along the outputs)");
  m.def("ggml_linear_segments", &ggml_linear_segments, kNoGil, py::arg("x"), py::arg("starts"),
        py::arg("parts"), py::arg("types"), py::arg("k"),
        "row segments, each times its own GGUF blocks, in one call (a MoE layer's experts)");
  m.def("ggml_get_rows", &ggml_get_rows, kNoGil, py::arg("w"), py::arg("type"), py::arg("ids"),
        py::arg("k"), "the rows ids of GGUF blocks, dequantized to float32");
  m.def("ggml_dequantize", &ggml_dequantize, kNoGil, py::arg("w"), py::arg("type"), py::arg("k"),
        "GGUF blocks [n, row_bytes] dequantized to float32 [n, k]");
  m.def("ggml_repack_types", &ggml_repack_types,
        "the GGML types this build moves into a layout of its own at load (ggml_repack)");
  m.def("ggml_amx", &ggml_amx, py::arg("mode") = -1,
        "whether K-quant prompt chunks run on AMX tiles (mode 0 / 1 switches, -1 asks)");
  m.def("ggml_repack", &ggml_repack, kNoGil, py::arg("w"), py::arg("type"), py::arg("k"),
        py::arg("release"), "a weight's blocks moved 16 (8) rows a group -> (the copy, its type)");
  m.def("ggml_row_bytes", &ggml_row_bytes, py::arg("type"), py::arg("k"),
        "bytes of a row of k values of a GGML type");
  m.def("step_layers", &step_layers_py, "every layer of a quantized step, bf16 or f32",
        py::arg("x"), py::arg("layers"), py::arg("groups"), py::arg("rope_tables"),
        py::arg("n_heads"), py::arg("eps"), py::arg("scale"), py::arg("group_size"),
        py::arg("gil_rows"), py::arg("state") = py::none());
  m.def("short_conv", &short_conv, kNoGil, py::arg("v"), py::arg("conv"), py::arg("weight"),
        py::arg("state"), "LFM2's short convolution over state slots, in place");
  m.def("mamba2_mix", &mamba2_mix, kNoGil, py::arg("zxbcdt"), py::arg("conv"), py::arg("ssm"),
        py::arg("params"), py::arg("state"), "the Mamba2 mixer between its linears, in place");
  m.def("mamba_mix", &mamba_mix, kNoGil, py::arg("xz"), py::arg("conv"), py::arg("ssm"),
        py::arg("params"), py::arg("state"), "the Mamba (1) mixer between its linears, in place");
  // quant_linear's and step_layers' arguments (kernels.h), built field by field from Python
  // (StepLinear: model/layers/quant.py and ggml.py step_linear; the rest model/runner/native.py);
  // module_local: every level's build is its own module, and a process may load several
  py::class_<StepLinear>(m, "StepLinear", py::module_local())
      .def(py::init<>())
      .def_readwrite("kind", &StepLinear::kind)
      .def_readwrite("small_rows", &StepLinear::small_rows)
      .def_readwrite("packed", &StepLinear::packed)
      .def_readwrite("w0", &StepLinear::w0)
      .def_readwrite("w1", &StepLinear::w1)
      .def_readwrite("w2", &StepLinear::w2)
      .def_readwrite("bias", &StepLinear::bias)
      .def_readwrite("dense_bias", &StepLinear::dense_bias)
      .def_readwrite("parts", &StepLinear::parts)
      .def_readwrite("types", &StepLinear::types);
  py::class_<StepLayer>(m, "StepLayer", py::module_local())
      .def(py::init<>())
      .def_readwrite("attn_norm", &StepLayer::attn_norm)
      .def_readwrite("ffn_norm", &StepLayer::ffn_norm)
      .def_readwrite("q_norm", &StepLayer::q_norm)
      .def_readwrite("k_norm", &StepLayer::k_norm)
      .def_readwrite("post_attn_norm", &StepLayer::post_attn_norm)
      .def_readwrite("post_ffn_norm", &StepLayer::post_ffn_norm)
      .def_readwrite("wqkv", &StepLayer::wqkv)
      .def_readwrite("wo", &StepLayer::wo)
      .def_readwrite("w13", &StepLayer::w13)
      .def_readwrite("w2", &StepLayer::w2)
      .def_readwrite("k_cache", &StepLayer::k_cache)
      .def_readwrite("v_cache", &StepLayer::v_cache)
      .def_readwrite("head_dim", &StepLayer::head_dim)
      .def_readwrite("groups", &StepLayer::groups)
      .def_readwrite("rope", &StepLayer::rope)
      .def_readwrite("rope_dim", &StepLayer::rope_dim)
      .def_readwrite("rope_interleaved", &StepLayer::rope_interleaved)
      .def_readwrite("softcap", &StepLayer::softcap)
      .def_readwrite("sinks", &StepLayer::sinks)
      .def_readwrite("rot_k", &StepLayer::rot_k)
      .def_readwrite("rot_v", &StepLayer::rot_v)
      .def_readwrite("k_center", &StepLayer::k_center)
      .def_readwrite("gelu", &StepLayer::gelu)
      .def_readwrite("residual_mult", &StepLayer::residual_mult)
      .def_readwrite("router", &StepLayer::router)
      .def_readwrite("expert_rows", &StepLayer::expert_rows)
      .def_readwrite("experts_w13", &StepLayer::experts_w13)
      .def_readwrite("experts_w2", &StepLayer::experts_w2)
      .def_readwrite("n_used", &StepLayer::n_used)
      .def_readwrite("norm_topk", &StepLayer::norm_topk)
      .def_readwrite("sigmoid_gating", &StepLayer::sigmoid_gating)
      .def_readwrite("selection_bias", &StepLayer::selection_bias)
      .def_readwrite("weights_scale", &StepLayer::weights_scale)
      .def_readwrite("router_bias", &StepLayer::router_bias)
      .def_readwrite("swiglu_limit", &StepLayer::swiglu_limit)
      .def_readwrite("swiglu_alpha", &StepLayer::swiglu_alpha)
      .def_readwrite("shared_expert", &StepLayer::shared_expert)
      .def_readwrite("shexp_gate", &StepLayer::shexp_gate)
      .def_readwrite("mamba2", &StepLayer::mamba2)
      .def_readwrite("ssm_in", &StepLayer::ssm_in)
      .def_readwrite("ssm_out", &StepLayer::ssm_out)
      .def_readwrite("mamba", &StepLayer::mamba)
      .def_readwrite("ssm_state", &StepLayer::ssm_state)
      .def_readwrite("ffn", &StepLayer::ffn)
      .def_readwrite("shortconv", &StepLayer::shortconv)
      .def_readwrite("conv_w", &StepLayer::conv_w)
      .def_readwrite("conv_state", &StepLayer::conv_state);
  py::class_<StepState>(m, "StepState", py::module_local())
      .def(py::init<>())
      .def_readwrite("decode_rows", &StepState::decode_rows)
      .def_readwrite("decode_slots", &StepState::decode_slots)
      .def_readwrite("prompt_bounds", &StepState::prompt_bounds)
      .def_readwrite("prompt_slots", &StepState::prompt_slots)
      .def_readwrite("captures", &StepState::captures)
      .def_readwrite("decode_run_lo", &StepState::decode_run_lo)
      .def_readwrite("decode_run_hi", &StepState::decode_run_hi);
  py::class_<StepMamba2>(m, "StepMamba2", py::module_local())
      .def(py::init<>())
      .def_readwrite("conv_w", &StepMamba2::conv_w)
      .def_readwrite("conv_b", &StepMamba2::conv_b)
      .def_readwrite("dt_bias", &StepMamba2::dt_bias)
      .def_readwrite("a", &StepMamba2::a)
      .def_readwrite("d", &StepMamba2::d)
      .def_readwrite("norm_w", &StepMamba2::norm_w)
      .def_readwrite("norm", &StepMamba2::norm)
      .def_readwrite("n_heads", &StepMamba2::n_heads)
      .def_readwrite("head_dim", &StepMamba2::head_dim)
      .def_readwrite("n_groups", &StepMamba2::n_groups)
      .def_readwrite("d_state", &StepMamba2::d_state)
      .def_readwrite("d_inner", &StepMamba2::d_inner)
      .def_readwrite("conv_dim", &StepMamba2::conv_dim)
      .def_readwrite("d_conv", &StepMamba2::d_conv)
      .def_readwrite("scan_chunk", &StepMamba2::scan_chunk)
      .def_readwrite("eps", &StepMamba2::eps);
  py::class_<StepMamba>(m, "StepMamba", py::module_local())
      .def(py::init<>())
      .def_readwrite("conv_w", &StepMamba::conv_w)
      .def_readwrite("conv_b", &StepMamba::conv_b)
      .def_readwrite("x_w", &StepMamba::x_w)
      .def_readwrite("dt_w", &StepMamba::dt_w)
      .def_readwrite("dt_b", &StepMamba::dt_b)
      .def_readwrite("a", &StepMamba::a)
      .def_readwrite("d", &StepMamba::d)
      .def_readwrite("dt_norm", &StepMamba::dt_norm)
      .def_readwrite("b_norm", &StepMamba::b_norm)
      .def_readwrite("c_norm", &StepMamba::c_norm)
      .def_readwrite("norm", &StepMamba::norm)
      .def_readwrite("d_inner", &StepMamba::d_inner)
      .def_readwrite("d_state", &StepMamba::d_state)
      .def_readwrite("d_conv", &StepMamba::d_conv)
      .def_readwrite("dt_rank", &StepMamba::dt_rank)
      .def_readwrite("eps", &StepMamba::eps);
  py::class_<StepGroups>(m, "StepGroups", py::module_local())
      .def(py::init<>())
      .def_readwrite("write_cells", &StepGroups::write_cells)
      .def_readwrite("decode_rows", &StepGroups::decode_rows)
      .def_readwrite("decode_cells", &StepGroups::decode_cells)
      .def_readwrite("decode_lens", &StepGroups::decode_lens)
      .def_readwrite("prompt_bounds", &StepGroups::prompt_bounds)
      .def_readwrite("prompt_cells", &StepGroups::prompt_cells)
      .def_readwrite("prompt_lens", &StepGroups::prompt_lens)
      .def_readwrite("prompt_firsts", &StepGroups::prompt_firsts);
}

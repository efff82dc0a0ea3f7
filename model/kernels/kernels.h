// Declarations shared by the kernel sources (model/kernels: one extension per ISA level).
#pragma once

// ATen only (not torch/extension.h: pybind11 and the C++ frontend double a build's time);
// bindings.cpp adds the bindings.
#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// 8 float32 partial sums of the products of 32 unsigned bytes w and signed bytes x (int4.cpp,
// int8.cpp): pairwise in int16 first (vpmaddubsw), so the caller keeps 2 * |w * x| below 2^15;
// one vpdpbusd with AVX-512 VNNI
inline __m256 dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// the sum of 8 float32 lanes
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// attention.cpp's kernels (attention_f32.cpp, attention_bf16.cpp): shared sizes and helpers
constexpr int kMaxQueries = 16;  // query vectors per task: a kv head's query heads x rows
constexpr int kMaxChunks = 8;    // head_dim / 32 (head_dim <= 256)
constexpr int64_t kAhead = 8;    // rows prefetched ahead: cells are scattered, not streamed

// s[0, m) -> softmax(s) in place, float32 (m >= 1); `sink` (null: none): one more logit in the
// denominator that weighs no row (gpt-oss's attention sinks)
inline void softmax_inplace(float* s, int64_t m, const float* sink = nullptr) {
  float mx = s[0];
  for (int64_t i = 1; i < m; ++i) mx = std::max(mx, s[i]);
  if (sink != nullptr) mx = std::max(mx, *sink);
  float sum = sink != nullptr ? std::exp(*sink - mx) : 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < m; ++i) s[i] *= inv;
}

// s[0, m) -> tanh(s / cap) * cap in place where cap > 0: Gemma 2's attention logit soft-capping
// (transformers' eager attention), on the scaled scores before the softmax
inline void softcap_inplace(float* s, int64_t m, float cap) {
  if (cap <= 0.0f) return;
  for (int64_t i = 0; i < m; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

#if defined(__AVX2__) && defined(__FMA__)
#define CELLSERVE_F32_AVX2 1
// One task in float32, head_dim % 8 == 0, head_dim <= 256 (attention_f32.cpp): `group` scaled
// query vectors q [group, hd] over the first n K/V rows read in place at cells (query g over
// its first qlens[g] <= n, where qlens is given, from its qfirsts[g] < qlens[g] on, where
// qfirsts is given); out[g] <- its output; scores: group * n floats;
// softcap > 0: the scores capped (softcap_inplace) before the softmax; sinks (null: none):
// query g's sink logit sinks[g] in its softmax's denominator.
void attend_f32(const float* q, int64_t group, const int64_t* qlens, const int64_t* qfirsts,
                int64_t hd, const float* kbase, const float* vbase, int64_t ks1, int64_t vs1,
                const int64_t* cells, int64_t n, float softcap, const float* sinks,
                float* scores, float* const* out);
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CELLSERVE_AVX512_BF16 1
inline void prefetch_row(const at::BFloat16* row, int64_t hd) {  // every 64-byte line of a row
  for (int64_t b = 0; b < hd; b += 32) __builtin_prefetch(row + b);
}

// One task in bfloat16, head_dim % 32 == 0 (attention_bf16.cpp): nq query vectors sharing one kv
// head over the K/V rows of cells sc[0, n) (query g over the first qlens[g]; null: all n; from
// its qfirsts[g] on; null: from 0);
// scores: room for nq * (n + 1) floats; softcap > 0: the scaled scores capped before the softmax;
// sinks (null: none): query g's sink logit sinks[g] in its softmax's denominator.
void attend_bf16(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
                 const int64_t* qfirsts, int64_t hd,
                 const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t kstride,
                 int64_t vstride, const int64_t* sc, int64_t n, float scale, float softcap,
                 const float* sinks, float* scores, at::BFloat16* const* dst);
#endif

// bfloat16 -> float32 (exact: the top 16 bits of the float)
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// n float32 values -> bfloat16, rounded to nearest even as at::BFloat16 rounds (one
// vcvtneps2bf16 per 16 where the CPU has it); a loop, not a torch op: no dispatch, no
// parallel region for a few thousand values
inline void to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#ifdef CELLSERVE_AVX512_BF16
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// kv_rows.cpp: K/V rows in kvcache/cache_types.py's types. A layer's cache [n_kv, n_cells, row]
// is float32, float16 or bfloat16 rows of head_dim, or uint8 rows of q8_0 / q4_0 blocks of 32
// (which one: its dtype and row length, cache_kind).
enum class CacheKind { F32, F16, BF16, Q8_0, Q4_0 };
CacheKind cache_kind(const at::Tensor& rows, int64_t hd);
int64_t cache_row_bytes(CacheKind kind, int64_t hd);
void dequant_row(CacheKind kind, const uint8_t* src, float* dst, int64_t hd);
void dequant_row(CacheKind kind, const uint8_t* src, at::BFloat16* dst, int64_t hd);
void encode_row(CacheKind kind, const float* x, uint8_t* dst, int64_t hd);  // ggml's rounding
at::Tensor dequant_cells(const at::Tensor& rows, const at::Tensor& cells, int64_t hd,
                         at::ScalarType dtype);
bool reads_cache_types();

// The rows of one kv head in a cache of another type than the kernel's T (float or bfloat16),
// as the attention kernels read them: each decoded, as dequant_row decodes it, into a scratch
// row of the caller's when it is read (stride: bytes between cells).
template <typename T>
struct CodedRows {
  const uint8_t* base;
  int64_t stride, hd;
  CacheKind kind;
  const T* row(int64_t cell, T* scratch) const {
    dequant_row(kind, base + cell * stride, scratch, hd);
    return scratch;
  }
  void prefetch(int64_t cell) const {  // every 64-byte line the row touches
    const uint8_t* p = base + cell * stride;
    const int64_t bytes = cache_row_bytes(kind, hd);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
    __builtin_prefetch(p + bytes - 1);
  }
};

#ifdef CELLSERVE_F32_AVX2
// attend_f32 over K and V rows of other cache types (kbytes / vbytes: bytes between cells), each
// row decoded to float32 when it is read, as dequant_row decodes it (attention_f32.cpp)
void attend_f32_coded(const float* q, int64_t group, const int64_t* qlens,
                      const int64_t* qfirsts, int64_t hd, CacheKind kkind,
                      const uint8_t* kbase, int64_t kbytes, CacheKind vkind, const uint8_t* vbase,
                      int64_t vbytes, const int64_t* cells, int64_t n,
                      float softcap, const float* sinks, float* scores, float* const* out);
#endif
#ifdef CELLSERVE_AVX512_BF16
// attend_bf16 over K and V rows of other cache types (kbytes / vbytes: bytes between cells), each
// row decoded to bfloat16 when it is read, as dequant_row decodes it (attention_bf16.cpp)
void attend_bf16_coded(const at::BFloat16* const* qrows, int64_t nq, const int64_t* qlens,
                       const int64_t* qfirsts, int64_t hd, CacheKind kkind,
                       const uint8_t* kbase, int64_t kbytes, CacheKind vkind, const uint8_t* vbase, int64_t vbytes, const int64_t* sc,
                       int64_t n, float scale, float softcap, const float* sinks, float* scores,
                       at::BFloat16* const* dst);
#endif

// softcap > 0: scores tanh(s / softcap) * softcap before the softmax (Gemma 2); 0: none.
// sinks: none, or [n_heads] logits, one more term in each head's softmax denominator (gpt-oss)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale,
                            double softcap,
                            const c10::optional<at::Tensor>& sinks = c10::nullopt);
// firsts: none, or [L] int64, the first of a prompt chunk's cells row i sees (sliding window)
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cells, const at::Tensor& lens, double scale,
                            double softcap,
                            const c10::optional<at::Tensor>& sinks = c10::nullopt,
                            const c10::optional<at::Tensor>& firsts = c10::nullopt);
bool has_bf16_kernels();
bool has_attention_sinks();
// layers.cpp: RMSNorm and silu(gate) * up of bfloat16 or float32 rows (the *_of ones by x's
// dtype), and the fused ops both paths call (into `out`: x's shape, contiguous)
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);
at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_f32(const at::Tensor& gate_up);
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_of(const at::Tensor& gate_up);
void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out);
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);
at::Tensor rope_neox_(at::Tensor x, const at::Tensor& c, const at::Tensor& s);
at::Tensor hadamard_(at::Tensor x, int64_t n);  // layers.cpp
// step.cpp: every layer of a step in one call (model/runner/native.py), each layer as its
// model.arch.LayerDesc describes it. A linear as model/layers/quant.py QuantLinear.step_linear
// (or ggml.py BlockLinear.step_linear) builds it, by kind:
// "int4_f32" (float32 rows, model/kernels): q4, q4_scale_min, q4_gemm; "q8" (float32 rows):
// q8 [n, k], q8_scale [n, k / 32], dense; "int4" (torch's, bfloat16 rows): int4pack,
// scales_zeros, dense; "int8" (torch's on bfloat16 rows, float32 ones rounded to bfloat16 and
// back): int8 [n, k], scales [n], dense. Up to
// small_rows rows the quantized kernel (+ bias), past them the dense copy (oneDNN-packed where
// `packed`, with dense_bias inside) or, for int4_f32, int4_gemm (+ bias).
// "ggml" (float32 or bfloat16 rows): parts (the GGUF's rows, [n_i, row_bytes_i] uint8) of
// types (GGML type ids), concatenated along the outputs: ggml_linear at every row count (+ bias).
struct StepLinear {
  std::string kind;
  at::Tensor w0, w1, w2;
  std::optional<at::Tensor> bias, dense_bias;
  int64_t small_rows = 0;
  bool packed = false;
  // "ggml": the GGUF's own blocks, parts concatenated along the outputs (ggml_linear)
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;
};
// A linear of any kind on rows a [m, k] (bfloat16 or float32; see StepLinear for the kinds each
// takes): y [m, n] in a's dtype. group_size: int4's group along k (model/layers/quant.py).
at::Tensor quant_linear(const at::Tensor& a, const StepLinear& w, int64_t group_size);
// model/layers/batch.py StateBatch, for the short-convolution layers: decode rows (rows: empty,
// rows [0, n_dec) in order) each one step from its slot of decode_slots; prompt chunks [start,
// end) (prompt_bounds: start, end, ...) each a scan from its slot of prompt_slots; captures
// (chunk i, r, slot, ...): once chunk i's first r rows are consumed, its state copied to slot.
// decode_run_lo / hi: the decode slots as a range [lo, hi) when they are one (-1: not).
struct StepState {
  at::Tensor decode_rows, decode_slots;
  std::vector<int64_t> prompt_bounds, prompt_slots, captures;
  int64_t decode_run_lo = -1, decode_run_hi = -1;
};
// the rows, slots and captures of `state` well formed for n rows over n_slots (else it throws)
void check_state(const StepState& state, int64_t n, int64_t n_slots, const char* who);
// prompt chunk p's captures, (r, slot) in ascending r
inline std::vector<std::pair<int64_t, int64_t>> captures_of(const StepState& state, int64_t p) {
  std::vector<std::pair<int64_t, int64_t>> caps;
  for (size_t i = 0; i + 2 < state.captures.size(); i += 3)
    if (state.captures[i] == p) caps.emplace_back(state.captures[i + 1], state.captures[i + 2]);
  return caps;
}
// A Mamba2 mixer's parameters (model/layers/mamba2.py Mamba2Mixer; model.arch.SSMArgs sizes)
struct StepMamba2 {
  at::Tensor conv_w, dt_bias, a, d, norm_w;  // [conv_dim, K], [H], [H], [H], [d_inner]
  std::optional<at::Tensor> conv_b;           // [conv_dim]
  int64_t n_heads = 0, head_dim = 0, n_groups = 0, d_state = 0, d_inner = 0, conv_dim = 0;
  int64_t d_conv = 0, scan_chunk = 64;
  double eps = 1e-5;
  // where the group RMSNorm goes (model.arch.SSMArgs.norm): 0 norm(y * silu(z)) (Mamba2),
  // 1 norm(y) * silu(z) (Falcon-H1's norm_before_gate), 2 none: y * silu(z) (norm_w unread)
  int64_t norm = 0;
};
// mamba2.cpp: the mixer between its linears, zxbcdt [n, >= d_in_proj] (in_proj's rows) ->
// the gated RMSNorm's output [n, d_inner] in zxbcdt's dtype; conv [n_slots, conv_dim, K - 1]
// and float32 ssm [n_slots, H, P, N] move in place (the Python layers call it too)
at::Tensor mamba2_mix(const at::Tensor& zxbcdt, at::Tensor conv, at::Tensor ssm,
                      const StepMamba2& m, const StepState& state);
// A Mamba (1) mixer's parameters (model/layers/mamba.py MambaMixer; model.arch.MambaArgs sizes)
struct StepMamba {
  // [d_inner, K] (model dtype); float32 [dt_rank + 2 N, d_inner], [d_inner, dt_rank],
  // [d_inner], [d_inner, N], [d_inner]
  at::Tensor conv_w, x_w, dt_w, dt_b, a, d;
  std::optional<at::Tensor> conv_b, dt_norm, b_norm, c_norm;  // the norms' weights (Jamba)
  bool norm = false;  // dt, B and C RMS-normed (with the weights that are set)
  int64_t d_inner = 0, d_state = 0, d_conv = 0, dt_rank = 0;
  double eps = 1e-6;
};
// mamba.cpp: the mixer between its linears, xz [n, >= 2 d_inner] (in_proj's rows) -> the gated
// scan output [n, d_inner] in xz's dtype; conv [n_slots, d_inner, K - 1] and float32 ssm
// [n_slots, d_inner, N] move in place (the Python layers call it too)
at::Tensor mamba_mix(const at::Tensor& xz, at::Tensor conv, at::Tensor ssm, const StepMamba& m,
                     const StepState& state);
// One block: the parts model/layers/decoder.py's Block has for the layer's LayerDesc, by its names
// (absent optionals: the description has no such part).
struct StepLayer {
  // attn_norm / ffn_norm: absent where the block has no pre-norms (OLMo 2, EXAONE 4.0);
  // q_norm / k_norm: [head_dim] per head, or [n_heads * head_dim] / [n_kv * head_dim] (OLMoE)
  std::optional<at::Tensor> attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffn_norm;
  StepLinear wqkv, wo, w13, w2;
  at::Tensor k_cache, v_cache;  // this layer's [n_kv_heads, n_cells, row] of its pool (any cache type)
  int64_t head_dim = 0;
  int64_t groups = 0;           // which of the step's StepGroups it attends (its window's)
  int64_t rope = 0;             // which rope table pair rotates it; -1: NoPE
  int64_t rope_dim = 0;         // the dims it rotates, from each head's start (0: the whole head)
  bool rope_interleaved = false;  // pairs (2i, 2i + 1) (GLM-4), not rotate-half's (i, i + dim/2)
  double softcap = 0.0;         // > 0: attention scores capped (Gemma 2)
  std::optional<at::Tensor> sinks;  // [n_heads]: a sink logit per head (gpt-oss)
  // > 0: q and k (rot_k), v and the attention's output (rot_v) go through hadamard_ with this
  // n after RoPE: the cache stores rotated rows (kvcache/rotation.py)
  int64_t rot_k = 0, rot_v = 0;
  std::optional<at::Tensor> k_center;  // [n_kv, head_dim] in x's dtype: k -= it, before rot_k
  bool gelu = false;            // GeGLU (tanh) instead of SwiGLU
  double residual_mult = 1.0;
  // a mixture-of-experts MLP (model/layers/moe.py MoEFeedForward) instead of w13 / w2: the
  // router [n_experts, dim] in x's dtype, each expert's gate|up and down linears, and the
  // module's expert_rows [n_experts] int64 (counted in place)
  std::optional<at::Tensor> router, router_bias, expert_rows;
  std::vector<StepLinear> experts_w13, experts_w2;
  int64_t n_used = 0;  // experts per row
  bool norm_topk = false;
  // LFM2-MoE: scores sigmoid(logits) instead of the softmax; the top n_used chosen on scores +
  // selection_bias [n_experts] float32 where set, weighted by the scores; the weights (after
  // norm_topk) times weights_scale
  bool sigmoid_gating = false;
  std::optional<at::Tensor> selection_bias;
  double weights_scale = 1.0;
  // > 0: the experts' activation is gpt-oss's clamped SwiGLU (model/layers/blocks.py
  // swiglu_oai) with this limit and swiglu_alpha; 0: SiLU(gate) * up
  double swiglu_limit = 0.0, swiglu_alpha = 0.0;
  // Qwen2-MoE: a shared expert after the routed ones, its gate|up and down in w13 / w2, its
  // output times sigmoid(x . shexp_gate) where shexp_gate [1, dim] is set
  bool shared_expert = false;
  std::optional<at::Tensor> shexp_gate;
  // LFM2's short-convolution mixer instead of attention: wqkv its in_proj (B, C, x), wo its
  // out_proj, conv_w [dim, L], conv_state this layer's [n_slots, dim, L - 1] (short_conv)
  bool shortconv = false;
  at::Tensor conv_w, conv_state;
  // a Mamba2 mixer instead: wqkv its in_proj, wo its out_proj, conv_state and ssm_state this
  // layer's slots (mamba2_mix); ffn false: no MLP half (Mamba2's blocks)
  std::optional<StepMamba2> mamba2;
  std::optional<StepMamba> mamba;  // a Mamba (1) mixer likewise (mamba_mix)
  at::Tensor ssm_state;
  // Falcon-H1: mamba2 runs BESIDE the attention (wqkv / wo the attention's), on the same normed
  // input, through these in_proj / out_proj; its output is added to the attention's
  std::optional<StepLinear> ssm_in, ssm_out;
  bool ffn = true;
};
// model/layers/batch.py AttnGroups, kernel-ready: where the rows' K/V go, per decode group its rows
// (empty: every row of the batch, in order), cells [n_seq, max_kv], lens [n_seq]; per prompt
// chunk its rows [start, end) (bounds: start, end, ...), cells [n_kv] in position order, lens,
// and firsts (a sliding window's chunk: the first cell each row sees; empty: 0 for every row).
struct StepGroups {
  at::Tensor write_cells;
  std::vector<at::Tensor> decode_rows, decode_cells, decode_lens;
  std::vector<int64_t> prompt_bounds;
  std::vector<at::Tensor> prompt_cells, prompt_lens, prompt_firsts;
};
// LFM2's short convolution (layers.cpp; model/layers/shortconv.py calls it too): w [n, d] in
// v's dtype, row t of a sequence = sum_j window_t[j] * weight[:, j] over the window of its last
// L values of v (the state's L - 1, oldest first, then its own), summed in float32 in that
// order, rounded once; conv [n_slots, d, L - 1] in v's dtype moves in place; weight [d, L].
// Rows in no group get 0.
at::Tensor short_conv(const at::Tensor& v, at::Tensor conv, const at::Tensor& weight,
                      const StepState& state);
// A mixture of experts' routing (model/layers/moe.py MoEFeedForward.route, step.cpp moe_ffn: both
// call it, so that both choose the same experts with the same weights): logits [n, n_experts]
// -> (weights [n, k] float32, experts [n, k] int64). Scores softmax(logits) (or sigmoid) in
// float32; the k largest scores (+ selection_bias [n_experts] float32 where given), largest
// first, ties to the lower expert; weighted by their scores, divided by their sum with
// norm_topk, times scale.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool norm_topk,
                                             bool sigmoid,
                                             const std::optional<at::Tensor>& selection_bias,
                                             double scale);
at::Tensor step_layers(at::Tensor x, const std::vector<StepLayer>& layers,
                       const std::vector<StepGroups>& groups,
                       const std::vector<at::Tensor>& rope_tables, int64_t n_heads, double eps,
                       double scale, int64_t group_size, const StepState& state);
bool has_f32_kernels();
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min);
// gemm.cpp: int4_mm's integers for batches, on pack_int4_gemm's layout; y [m, n]
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n);

// int4.cpp: x [m, k] float32 (k % 32 == 0) -> int8 per group of 32 in [-127, 127], the group's
// scale d = max|x| / 127 and d * the sum of its int8 values (GGUF's Q8_1 block), each [m, k / 32]
void quantize_rows_q8(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s);
struct Q8Rows {  // quantize_rows_q8's output for m rows of k
  const int8_t* q;  // [m, k]
  const float* d;   // [m, k / 32]
  const float* s;   // [m, k / 32]
};
// int4.cpp: x [m, k] float32, contiguous -> quantize_rows_q8 into this thread's buffers (valid
// until its next call; pointers, so that parallel tasks read the caller's buffers)
Q8Rows quantize_rows(const at::Tensor& x);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
// int4.cpp: what int4_mm and int8_mm share: x [m, k] float32 -> y [m, n] float32, the rows
// quantized once (quantize_rows_q8), then tasks of output blocks (a block's weights stay in L1
// while every tile of <= 4 rows passes over them); tile(rows, m_tile, o0, o1, y_tile) fills
// y_tile[r * n + o] for r < m_tile, o in [o0, o1).
using Q8Tile = c10::function_ref<void(const Q8Rows&, int64_t, int64_t, int64_t, float*)>;
at::Tensor q8_matmul(const at::Tensor& x, int64_t n, Q8Tile tile);
// ggml_blocks.cpp (the K-quants: ggml_kquants.cpp): a GGUF file's own quantized blocks (GGML type ids: F32=0, F16=1, Q4_0=2,
// Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14, BF16=30), rows as the file stores
// them ([n, row_bytes] uint8). ggml_linear: x [m, k] float32 or bfloat16 times every part's rows
// (concatenated along the outputs) -> [m, sum n_i] in x's dtype, in int8 per block;
// ggml_get_rows: rows ids dequantized -> [m, k] float32; ggml_dequantize: all of them.
int64_t ggml_row_bytes(int64_t type, int64_t k);
at::Tensor ggml_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& types, int64_t k);
// ggml_linear of several row segments, each with its own parts (the same output count): rows
// [starts[s], starts[s + 1]) times seg_parts[s], in one parallel region; each segment's rows get
// the bits a ggml_linear of them alone gives (a MoE layer's experts: step.cpp moe_ffn)
at::Tensor ggml_linear_segments(const at::Tensor& x, const std::vector<int64_t>& starts,
                                const std::vector<std::vector<at::Tensor>>& seg_parts,
                                const std::vector<std::vector<int64_t>>& seg_types, int64_t k);
at::Tensor ggml_get_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, int64_t k);
at::Tensor ggml_dequantize(const at::Tensor& w, int64_t type, int64_t k);
// the GGML types this build moves into a layout of its own at load (Q4_K on the AVX2 and AVX-512 builds), and
// that move: the same bytes, 16 (8) rows a group -> (the copy, its type for ggml_linear)
std::vector<int64_t> ggml_repack_types();
// whether prompt chunks of K-quants run on AMX tiles: mode 0 / 1 switches (1: where the CPU and
// Linux allow it), -1 asks
bool ggml_amx(int64_t mode);
std::tuple<at::Tensor, int64_t> ggml_repack(const at::Tensor& w, int64_t type, int64_t k, bool release);

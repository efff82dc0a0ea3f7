// ggml_linear / ggml_get_rows / ggml_dequantize: compute on a GGUF file's own quantized blocks
// (llama.cpp's block formats, as the file stores them: no repack, no dense float copy).
//
// Block formats (GGML type id: values per block, bytes per block; d, dmin, m: fp16):
//   Q4_0 (2):  32, 18   d, qs[16]                w = d * (q - 8)        q: nibbles (j: qs[j] low,
//   Q4_1 (3):  32, 20   d, m, qs[16]             w = d * q + m           16 + j: qs[j] high)
//   Q5_0 (6):  32, 22   d, qh[4], qs[16]         w = d * (q - 16)       5th bit: bit j of qh
//   Q5_1 (7):  32, 24   d, m, qh[4], qs[16]      w = d * q + m
//   Q8_0 (8):  32, 34   d, int8 qs[32]           w = d * q
//   MXFP4 (39): 32, 17  e (E8M0), qs[16]         w = kMxfp4[q] * 2^(e - 128)   q: as Q4_0's
//   Q4_K (12): 256, 144 d, dmin, scales[12], qs[128]   8 sub-blocks of 32 with a 6-bit scale
//              and min each: w = d * sc * q - dmin * mn; qs in chunks of 32 bytes, the low
//              nibbles sub-block 2c, the high ones 2c + 1
//   Q5_K (13): 256, 176 d, dmin, scales[12], qh[32], qs[128]: Q4_K plus bit s of qh[l] as the
//              5th bit of sub-block s's value l
//   Q6_K (14): 256, 210 ql[128], qh[64], int8 scales[16], d: w = d * scales[i / 16] * (q - 32)
//   F32 (0), F16 (1), BF16 (30): one value per "block".
//
// The integer paths (activations in int8, as llama.cpp's q8_0 / q8_K):
// - K-quants (Q4_K, Q5_K, Q6_K; every build; ggml_kquants.cpp): each activation row quantized
//   per 256 values, each super-block's sums exact in int32 with its integer scales, two float
//   operations per super-block and (output, row); register tiles with the outputs interleaved
//   into a vector's lanes (8 a vector, 16 with AVX-512 VNNI).
// - the 32-value kinds on AVX2 / AVX-512: rows per 32 values
//   (quantize_rows_q8, int4.cpp: d = max|x| / 127 and s = d * the sum of the int8 values),
//   unsigned decoded blocks (w = d * u + mn), the same register tiles (see "the 32-value kinds").
// - the portable build's 32-value kinds: rows_q below, in plain C++, per 32 values: each
//   weight block decoded into int8 values with a float scale per 16 values and, for the kinds
//   with a minimum (Q4_1, Q5_1), a float minimum per 32 (the offsets of Q4_0 / Q5_0 taken into
//   the signed values); per 32 values the dot product exact in int32 in 8 lanes of 4 values,
//   scaled in float32:
//   y[r, o] = sum_blocks sum_lanes scale[lane] * d_x[r, g] * dot + sum_g min[g] * s_x[r, g];
//   tiled: tasks of kOutBlock outputs (parallel); within a task, tiles of rows (sized so that
//   their int8 rows stay in L1), within those each output's blocks decoded once into L1 and
//   applied to every row of the tile.
// The float kinds take rows_q's tiling with a float row.
#include "ggml_formats.h"
#include "ggml_q32gemv.h"  // q_gemv_rows (a few rows), kQGemvRows
#include "ggml_q32tiles.h"  // q_task (the tiles), kQ

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace {

using namespace ggml;

constexpr int64_t kOutBlock = 16;  // outputs per task: their weights stay in L1/L2 over row tiles
constexpr int64_t kAmxBigRows = 128;  // rows from which AMX tasks take more outputs (below)

// ---- the dequantized values (ggml_dequantize, ggml_get_rows, the float kinds' rows) ----------

// NOTE: no contraction into an FMA: the values must be gguf-py's (d * q, then + m) bit for bit.
template <int64_t T>
__attribute__((optimize("fp-contract=off"))) void dequant_row_q(const uint8_t* row, int64_t k,
                                                                float* out) {
  using F = Fmt<T>;
  alignas(64) int8_t q[F::E];
  float sc[F::E / 16], mn[F::E / 32 > 0 ? F::E / 32 : 1];
  for (int64_t b = 0; b < k / F::E; ++b) {
    F::decode(row + b * F::B, q, sc, mn);
    float* o = out + b * F::E;
    for (int64_t i = 0; i < F::E; ++i) {
      const float v = sc[i / 16] * static_cast<float>(q[i]);
      o[i] = F::kHasMin ? v + mn[i / 32] : v;
    }
  }
}

void dequant_row(int64_t type, const uint8_t* row, int64_t k, float* out) {
  switch (type) {
    case F32: std::memcpy(out, row, k * 4); return;
    case F16:
      for (int64_t i = 0; i < k; ++i) out[i] = fp16(row + 2 * i);
      return;
    case BF16:
      for (int64_t i = 0; i < k; ++i) out[i] = bf16(row + 2 * i);
      return;
    case Q4_0: return dequant_row_q<Q4_0>(row, k, out);
    case Q4_1: return dequant_row_q<Q4_1>(row, k, out);
    case Q5_0: return dequant_row_q<Q5_0>(row, k, out);
    case Q5_1: return dequant_row_q<Q5_1>(row, k, out);
    case Q8_0: return dequant_row_q<Q8_0>(row, k, out);
    case MXFP4: return dequant_row_q<MXFP4>(row, k, out);
    case Q4_K: return dequant_row_q<Q4_K>(row, k, out);
    case Q5_K: return dequant_row_q<Q5_K>(row, k, out);
    case Q6_K: return dequant_row_q<Q6_K>(row, k, out);
    default: type_info(type);  // raises
  }
}

// ---- the integer kernels ------------------------------------------------------------------------

struct Task {
  int64_t part, o0, o1;  // outputs [o0, o1) of parts[part]
};

struct Linear {
  const Q8Rows* xq;    // the int8 rows (quantized kinds)
  const float* xf;     // the float32 rows (float kinds)
  int64_t m, k, n;     // rows, inputs, all outputs
  float* y;            // [m, n]
  int64_t row_tile;    // rows whose int8 values stay in L1 while a task's outputs pass
};

using Acc = float;  // 8 a row
// a row's 8 lanes and its minimums' term. Not inlined: under -ffast-math the compiler
// vectorized this sum across 4 rows of a tile in one order and summed a lone row in another,
// so a row's y depended on the rows beside it (the portable build only)
__attribute__((noinline)) float lanes_total(const float* a, float m) {
  float t = 0.f;
  for (int lane = 0; lane < 8; ++lane) t += a[lane];
  return t + m;
}

// portable C++: the same integers (8 lanes of 4 values a block of 32) and float32 scaling
template <int64_t T>
void rows_q(const Linear& L, const uint8_t* wrow, int64_t r0, int64_t r1, float* y_col,
            Acc* acc, float* macc) {
  using F = Fmt<T>;
  constexpr int64_t S = F::E / kQ;
  const int64_t groups = L.k / kQ, nr = r1 - r0;
  alignas(64) int8_t q[F::E];
  float sc[F::E / 16], mn[S];
  for (int64_t r = 0; r < 8 * nr; ++r) acc[r] = 0.f;
  for (int64_t r = 0; r < nr; ++r) macc[r] = 0.f;
  for (int64_t b = 0; b < L.k / F::E; ++b) {
    F::decode(wrow + b * F::B, q, sc, mn);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t g0 = (r0 + r) * groups + b * S;
      const int8_t* xr = L.xq->q + g0 * kQ;
      const float* xd = L.xq->d + g0;
      float* a = acc + 8 * r;
      for (int64_t s = 0; s < S; ++s) {
        for (int lane = 0; lane < 8; ++lane) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i)
            dot += static_cast<int32_t>(q[s * kQ + 4 * lane + i]) * xr[s * kQ + 4 * lane + i];
          a[lane] += static_cast<float>(dot) * (sc[2 * s + lane / 4] * xd[s]);
        }
      }
      if constexpr (F::kHasMin) {
        const float* xs = L.xq->s + g0;
        for (int64_t s = 0; s < S; ++s) macc[r] += mn[s] * xs[s];
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) y_col[(r0 + r) * L.n] = lanes_total(acc + 8 * r, macc[r]);
}


// a float part's output o over rows [r0, r1): its row dequantized once into wf
void rows_f(const Linear& L, int64_t type, const uint8_t* wrow, int64_t r0, int64_t r1,
            float* y_col, float* wf) {
  dequant_row(type, wrow, L.k, wf);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = L.xf + r * L.k;
    float acc = 0.f;
    for (int64_t i = 0; i < L.k; ++i) acc += xr[i] * wf[i];
    y_col[r * L.n] = acc;
  }
}

void run_task(const Linear& L, int64_t type, const uint8_t* w, int64_t row_bytes, int64_t o0,
              int64_t o1, int64_t col0) {
  thread_local std::vector<float> accbuf, macc, wf;  // up to 16 lanes a row, 64-byte aligned
  accbuf.resize(16 * L.row_tile + 16);
  const auto at = reinterpret_cast<uintptr_t>(accbuf.data());
  auto* acc = reinterpret_cast<Acc*>((at + 63) & ~uintptr_t{63});
  macc.resize(L.row_tile);
  if (!type_info(type).quantized) wf.resize(L.k);
  for (int64_t r0 = 0; r0 < L.m; r0 += L.row_tile) {
    const int64_t r1 = std::min(L.m, r0 + L.row_tile);
    for (int64_t o = o0; o < o1; ++o) {
      const uint8_t* wrow = w + o * row_bytes;
      float* y_col = L.y + col0 + o;
      switch (type) {
        case Q4_0: rows_q<Q4_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q4_1: rows_q<Q4_1>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q5_0: rows_q<Q5_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q5_1: rows_q<Q5_1>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case Q8_0: rows_q<Q8_0>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        case MXFP4: rows_q<MXFP4>(L, wrow, r0, r1, y_col, acc, macc.data()); break;
        default: rows_f(L, type, wrow, r0, r1, y_col, wf.data());
      }
    }
  }
}

#if defined(CELLSERVE_GGML_TILE32)
// A task's outputs of a 32-value part: a few rows to q_gemv (the same bits as the tiles, read
// faster), more to the tiles
template <int64_t T>
void q_part(const Q8Rows& X, int64_t m, int64_t k, int64_t n, float* y, int64_t q_tile,
            const uint8_t* w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t col0) {
  if (m <= kQGemvRows) return q_gemv_rows<T>(X, m, k, n, y, w, row_bytes, o0, o1, col0);
  q_task<T>(X, m, k, n, y, q_tile, w, row_bytes, o0, o1, col0);
}
#endif

void check_weight(const at::Tensor& w, int64_t type, int64_t k, const char* what) {
  const TypeInfo t = type_info(type);
  TORCH_CHECK_VALUE(k > 0 && k % t.elems == 0, what, ": k = ", k, " is not a multiple of ",
                    t.elems, " (GGML type ", type, "'s block)");
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), what,
                    ": weights must be a contiguous [n, row_bytes] uint8 tensor, got ",
                    w.scalar_type(), " ", w.sizes());
  TORCH_CHECK_VALUE(w.size(1) == k / t.elems * t.bytes, what, ": rows of ", w.size(1),
                    " bytes, but GGML type ", type, " stores ", k, " values in ",
                    k / t.elems * t.bytes);
}

}  // namespace

int64_t ggml_row_bytes(int64_t type, int64_t k) {
  const TypeInfo t = type_info(type);
  TORCH_CHECK_VALUE(k >= 0 && k % t.elems == 0, "ggml_row_bytes: k = ", k,
                    " is not a multiple of ", t.elems, " (GGML type ", type, "'s block)");
  return k / t.elems * t.bytes;
}

at::Tensor ggml_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& types, int64_t k) {
  return ggml_linear_segments(x_in, {0, x_in.dim() == 2 ? x_in.size(0) : 0}, {parts}, {types}, k);
}

// Task boundaries [b_0 = 0, ..., b_nth = n_tasks) for nth threads: contiguous runs of about
// equal work, a task's work its outputs times (its segment's rows + kTaskRead), the constant
// standing for reading its weights once whatever the rows
constexpr int64_t kTaskRead = 4;
template <typename Task>
std::vector<int64_t> balanced_runs(const std::vector<Task>& tasks, const std::vector<int64_t>& starts,
                                   int64_t nth) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  nth = std::max<int64_t>(1, std::min(nth, n));
  std::vector<int64_t> work(n + 1, 0);
  for (int64_t t = 0; t < n; ++t)
    work[t + 1] = work[t] + (tasks[t].o1 - tasks[t].o0) *
                                (starts[tasks[t].seg + 1] - starts[tasks[t].seg] + kTaskRead);
  std::vector<int64_t> bounds(nth + 1, n);
  bounds[0] = 0;
  for (int64_t i = 1, t = 0; i < nth; ++i) {  // the first task whose work midpoint passes i / nth
    while (t < n && 2 * nth * work[t] + nth * (work[t + 1] - work[t]) < 2 * i * work[n]) ++t;
    bounds[i] = t;
  }
  return bounds;
}

// Segment s: rows [starts[s], starts[s + 1]) of x times its own parts. Every row is quantized
// once (each row on its own: the same int8 values whatever the rows beside it), and every
// segment's output blocks are tasks of one parallel region; within a segment each kernel runs
// over its m_s rows exactly as a ggml_linear of those rows alone would (k_gemv up to a few rows,
// the tiles past them), so each segment's y is that call's, bit for bit.
at::Tensor ggml_linear_segments(const at::Tensor& x_in, const std::vector<int64_t>& starts,
                                const std::vector<std::vector<at::Tensor>>& seg_parts,
                                const std::vector<std::vector<int64_t>>& seg_types, int64_t k) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat ||
                                        x_in.scalar_type() == at::kBFloat16),
                    "ggml_linear: x must be [m, k] float32 or bfloat16, got ", x_in.scalar_type(),
                    " ", x_in.sizes());
  TORCH_CHECK_VALUE(x_in.size(1) == k, "ggml_linear: x has ", x_in.size(1), " columns, k = ", k);
  const int64_t m = x_in.size(0), n_seg = static_cast<int64_t>(seg_parts.size());
  TORCH_CHECK_VALUE(n_seg >= 1 && seg_types.size() == seg_parts.size() &&
                        static_cast<int64_t>(starts.size()) == n_seg + 1 && starts[0] == 0 &&
                        starts[n_seg] == m,
                    "ggml_linear: segments must cover the rows: starts [0, ..., m], one parts / "
                    "types list each");
  bool any_q = false, any_k = false, any_f = false;
  int64_t n = -1;
  for (int64_t s = 0; s < n_seg; ++s) {
    const auto& parts = seg_parts[s];
    const auto& types = seg_types[s];
    TORCH_CHECK_VALUE(starts[s] <= starts[s + 1], "ggml_linear: segment ", s, " ends before it starts");
    TORCH_CHECK_VALUE(!parts.empty() && parts.size() == types.size(), "ggml_linear: ",
                      parts.size(), " parts and ", types.size(), " types");
    int64_t ns = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      check_weight(parts[i], types[i], k, "ggml_linear");
      (is_k(types[i]) ? any_k : type_info(types[i]).quantized ? any_q : any_f) = true;
      ns += parts[i].size(0);
    }
    TORCH_CHECK_VALUE(n < 0 || ns == n, "ggml_linear: segments with ", n, " and ", ns, " outputs");
    n = ns;
  }
  // bfloat16 rows (the AVX-512 BF16 path's activations) in and out through plain loops: a
  // torch conversion of a verification step's 17 x 8960 outputs is a parallel region of its
  // own, ~12% of a speculative step in a profile on a busy 2-core Zen 4
  const bool bf16_io = x_in.scalar_type() == at::kBFloat16;
  at::Tensor x;
  if (x_in.scalar_type() == at::kFloat) {
    x = x_in.contiguous();
  } else if (bf16_io) {
    const at::Tensor xb = x_in.contiguous();
    x = at::empty({m, k}, xb.options().dtype(at::kFloat));
    const at::BFloat16* src = xb.data_ptr<at::BFloat16>();
    float* dst = x.data_ptr<float>();
    // both threads on a prompt chunk's rows (512 x 8960 on one thread: ~10% of the down
    // projection's call at 512 rows, Zen 4); a decode step's few rows stay on this one
    at::parallel_for(0, m * k, 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dst[i] = to_float(src[i]);
    });
  } else {
    x = x_in.to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
  at::Tensor out = bf16_io ? at::empty({m, n}, x_in.options()) : y;
  const bool direct = x_in.scalar_type() == at::kFloat || bf16_io;  // else: y converted at the end
  if (m == 0 || n == 0) return direct ? out : y.to(x_in.scalar_type());
  TORCH_CHECK_VALUE(!any_q || k % kQ == 0, "ggml_linear: k must be a multiple of 32");
  Q8Rows rows{nullptr, nullptr, nullptr};
  if (any_q) rows = quantize_rows(x);
  Q8K krows{nullptr, nullptr, nullptr, nullptr, nullptr};
  if (any_k) krows = quantize_rows_k(x.data_ptr<float>(), m, k);
  // rows per tile: their int8 values (k bytes a row) within ~32 KB of L1
  const int64_t row_tile = std::clamp<int64_t>(32768 / k, 4, 64);
  const int64_t k_tile = k_tile_rows(k);
#if defined(CELLSERVE_GGML_TILE32)
  const int64_t q_tile = std::max<int64_t>(kMR32, std::min<int64_t>(kQTile, 32768 / k) / kMR32 * kMR32);
#endif
  // each segment's rows: its views of the quantized rows, the float rows and y
  const int64_t groups = k / kQ, nb = k / 256;
  std::vector<Q8Rows> seg_rows(n_seg);
  std::vector<Q8K> seg_krows(n_seg);
  std::vector<Linear> seg_L;
  seg_L.reserve(n_seg);
  for (int64_t s = 0; s < n_seg; ++s) {
    const int64_t r0 = starts[s], ms = starts[s + 1] - r0;
    if (any_q) seg_rows[s] = {rows.q + r0 * k, rows.d + r0 * groups, rows.s + r0 * groups};
    if (any_k)
      seg_krows[s] = {krows.q + r0 * k, krows.d + r0 * nb, krows.mx + r0 * (k / 16),
                      krows.s16 + r0 * (k / 16), krows.s32 + r0 * (k / 32)};
    seg_L.push_back({&seg_rows[s], any_f ? x.data_ptr<float>() + r0 * k : nullptr, ms, k, n,
                     y.data_ptr<float>() + r0 * n, row_tile});
  }
  struct SegTask {
    int64_t seg, part, o0, o1, col0;
  };
  std::vector<SegTask> tasks;
  for (int64_t s = 0; s < n_seg; ++s) {
    if (starts[s + 1] == starts[s]) continue;
    const auto& parts = seg_parts[s];
    // a prompt chunk on AMX: about 4 tasks a thread, each passing a tile of rows (kept in L2)
    // over all its columns, instead of every 16 outputs reading all the rows again (at k = 8960
    // and 512 rows, 4.5 MB from L3 per 16 outputs: the AMX tiles waited on it)
    int64_t block = kOutBlock;
    if (any_k && starts[s + 1] - starts[s] >= kAmxBigRows && amx_mode(-1))
      block = std::max<int64_t>(kOutBlock, n / (4 * at::get_num_threads()) / kOutBlock * kOutBlock);
    for (size_t i = 0, c = 0; i < parts.size(); c += parts[i].size(0), ++i)
      for (int64_t o = 0; o < parts[i].size(0); o += block)
        tasks.push_back({s, static_cast<int64_t>(i), o, std::min(parts[i].size(0), o + block),
                         static_cast<int64_t>(c)});
  }
  // each thread takes a contiguous run of tasks (its weights one stream) of about equal work:
  // the tasks' rows differ by segment (a MoE layer's experts took 3-15 rows each of a c=32
  // decode step), and at::parallel_for's equal counts of tasks left one thread waiting
  const std::vector<int64_t> bounds = balanced_runs(tasks, starts, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t t = bounds[i0]; t < bounds[i1]; ++t) {
      const SegTask& task = tasks[t];
      const at::Tensor& w = seg_parts[task.seg][task.part];
      const int64_t type = seg_types[task.seg][task.part];
      const uint8_t* wp = w.data_ptr<uint8_t>();
      const int64_t c0 = task.col0, r0 = starts[task.seg];
      const Linear& L = seg_L[task.seg];
      const int64_t ms = L.m;
      const Q8Rows& qr = seg_rows[task.seg];
      const Q8K& kr = seg_krows[task.seg];
      float* yp = L.y;
      switch (type) {
        case Q4_K:
        case Q5_K:
        case Q6_K:
        case Q4_K_X16:
        case Q4_K_X8: k_part(type, kr, ms, k, n, yp, k_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#if defined(CELLSERVE_GGML_TILE32)
        case Q4_0: q_part<Q4_0>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q4_1: q_part<Q4_1>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_0: q_part<Q5_0>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q5_1: q_part<Q5_1>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case Q8_0: q_part<Q8_0>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
        case MXFP4: q_part<MXFP4>(qr, ms, k, n, yp, q_tile, wp, w.size(1), task.o0, task.o1, c0); break;
#endif
        default: run_task(L, type, wp, w.size(1), task.o0, task.o1, c0);
      }
      if (bf16_io) {  // this task's outputs, while they are in cache
        at::BFloat16* ob = out.data_ptr<at::BFloat16>() + r0 * n;
        for (int64_t r = 0; r < ms; ++r)
          to_bf16(yp + r * n + c0 + task.o0, ob + r * n + c0 + task.o0, task.o1 - task.o0);
      }
    }
  });
  return direct ? out : y.to(x_in.scalar_type());
}

at::Tensor ggml_get_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids_in, int64_t k) {
  check_weight(w, type, k, "ggml_get_rows");
  TORCH_CHECK_VALUE(type != Q4_K_X16 && type != Q4_K_X8, "ggml_get_rows: a repacked Q4_K is for ggml_linear only");
  TORCH_CHECK_VALUE(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong,
                    "ggml_get_rows: ids must be a 1-D int64 tensor");
  const auto ids = ids_in.contiguous();
  const int64_t m = ids.size(0), n = w.size(0), row_bytes = w.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < n, "ggml_get_rows: id ", ip[i], " out of [0, ", n,
                      ")");
  auto out = at::empty({m, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row(type, wp + ip[i] * row_bytes, k, op + i * k);
  });
  return out;
}

at::Tensor ggml_dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  check_weight(w, type, k, "ggml_dequantize");
  TORCH_CHECK_VALUE(type != Q4_K_X16 && type != Q4_K_X8, "ggml_dequantize: a repacked Q4_K is for ggml_linear only");
  const int64_t n = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row(type, wp + i * row_bytes, k, op + i * k);
  });
  return out;
}

bool ggml_amx(int64_t mode) { return amx_mode(mode); }

std::vector<int64_t> ggml_repack_types() {
  if (repack_type() != 0) return {Q4_K};
  return {};
}

// A Q4_K weight moved into ggml_krepack.h's layout (the same bytes, 16 or 8 rows a group) -> (the
// copy, this build's repacked type). release: the weight is a view of a read-only file mapping, whose pages the move
// read; they are dropped from this process (the page cache keeps them), so the resident set
// holds the weight once.
std::tuple<at::Tensor, int64_t> ggml_repack(const at::Tensor& w, int64_t type, int64_t k, bool release) {
  check_weight(w, type, k, "ggml_repack");
  TORCH_CHECK_VALUE(type == Q4_K && repack_type() != 0, "ggml_repack: this build repacks ",
                    repack_type() != 0 ? "Q4_K (12)" : "nothing", ", not GGML type ", type);
  TORCH_CHECK_VALUE(w.size(0) % repack_lanes() == 0, "ggml_repack: ", w.size(0),
                    " rows, not a multiple of ", repack_lanes());
  auto out = at::empty_like(w);
  repack_q4k(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), w.size(0), w.size(1));
#if defined(__unix__)
  if (release) {
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto a = reinterpret_cast<uintptr_t>(w.data_ptr<uint8_t>());
    const uintptr_t lo = (a + page - 1) / page * page, hi = (a + w.numel()) / page * page;
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }
#endif
  return {out, repack_type()};
}

// The decoder layers of a model with fp32 activations on the CPU, run as one native call per
// step.
//
// Driving a small model's layers from Python costs about a dozen calls per layer at a few
// microseconds each (norms, projections, rope, cache write, attention, activation, residual
// adds): ~5 ms per step for SmolLM2's 30 layers, at any batch size. That is most of a
// single-stream decode step with int4 weights (~70 MB read, ~3 ms), and 5-10 % of a batched
// one. Here the same kernels and the same torch ops run from one C++ loop over the layers,
// in the same order, so the results are the same bit for bit: the Python model
// (kvserve/models) stays the reference, and the tests hold the two together.
#include "decoder.h"
#include "cpu_ops.h"
#include "moe_routing.h"
#include "step_team.h"
#include "dense_linear.h"
#include "quant_linear.h"
#include "w8a8_linear.h"
#include "row_table.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Which rows of the step are prompt tokens (kvserve/token_roles.py): a dual-format linear
// computes them with its prefill (bf16) weights, the generated rows with its Q4_1 weights.
struct TokenRoles {
  enum class Kind : int64_t { kAllGenerated = 0, kAllPrompt = 1, kMixed = 2 };  // token_roles.py's order
  Kind kind = Kind::kAllGenerated;
  torch::Tensor prompt_rows, generated_rows;  // kMixed: each role's sorted rows
  // kMixed: a role's rows as one run (start, length) when consecutive (no gather), else length 0.
  int64_t prompt_start = 0, prompt_len = 0, generated_start = 0, generated_len = 0;
};

// (start, length) of sorted distinct rows when they are consecutive, else (0, 0).
std::pair<int64_t, int64_t> row_run(const torch::Tensor& rows) {
  const int64_t n = rows.numel();
  if (n == 0) return {0, 0};
  const int64_t* r = rows.data_ptr<int64_t>();
  return r[n - 1] - r[0] + 1 == n ? std::make_pair(r[0], n) : std::make_pair(int64_t{0}, int64_t{0});
}

// One linear layer, as kvserve.quant / torch store it (see kvserve/models/fused.py).
struct Linear {
  enum class Kind { kQ4, kQ5, kTiles, kTilesInt8, kQ8, kBf16, kW8A8, kFp32, kOneDnnBf16, kInt8, kDense, kSegments };
  Kind kind = Kind::kDense;
  // Q4: qs, dm; Q5: qs, d (+ qh in `extra`); tiles (Q4 / Q5 on AVX512 and AVX2): packed, out_features
  // given; Q8: qs, d; int8: weight, scales; bf16: packed; w8a8: packed codes, affine constants;
  // fp32 / oneDNN / dense: weight
  torch::Tensor weight, scales, extra;
  // kSegments (kvserve.quant.SegmentedLinear): consecutive output rows in their own formats.
  std::vector<Linear> segments;
  c10::optional<torch::Tensor> bias;
  int64_t out_features = 0;
  // A block-quantized layer's copy of its weights for the prompt rows, bf16 or w8a8, or its own
  // tiles on the int8 prompt path (null: every row uses the above).
  std::shared_ptr<const Linear> prefill;

  // The rows of x each with the weights of its role, as TokenRoles.apply does in Python, into
  // out [rows, out_features] (contiguous rows; a row or column range of a wider tensor is fine).
  void into(const torch::Tensor& out, const torch::Tensor& x, const TokenRoles& roles) const {
    if (!prefill || roles.kind == TokenRoles::Kind::kAllGenerated) return into(out, x);
    if (roles.kind == TokenRoles::Kind::kAllPrompt) return prefill->into(out, x);
    const auto part = [&](const Linear& linear, const torch::Tensor& rows, int64_t start, int64_t len) {
      if (len) {
        linear.into(out.narrow(0, start, len), x.narrow(0, start, len));
      } else {
        out.index_copy_(0, rows, linear(x.index_select(0, rows)));
      }
    };
    part(*prefill, roles.prompt_rows, roles.prompt_start, roles.prompt_len);
    part(*this, roles.generated_rows, roles.generated_start, roles.generated_len);
  }

  // Whether every call runs kvserve's kernels (a step team's helpers take only their parallel
  // work; a torch op in a team would run on one thread): this layer, its segments and its copy.
  bool team_safe() const {
    if (!writes_in_place() || (prefill && !prefill->team_safe())) return false;
    return std::all_of(segments.begin(), segments.end(), [](const Linear& s) { return s.team_safe(); });
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (!writes_in_place()) return computed(x);
    auto out = torch::empty({x.size(0), out_features}, x.options());
    into(out, x);
    return out;
  }

  void into(const torch::Tensor& out, const torch::Tensor& x) const {
    switch (kind) {
      case Kind::kQ4: q4_linear_out(out, x, weight, scales, bias); return;
      case Kind::kQ5: q5_linear_out(out, x, weight, extra, scales, bias); return;
      case Kind::kTiles: tiled_nibble_linear_out(out, x, weight, bias); return;  // Int4Linear / Q5Linear on AVX512 and AVX2
      case Kind::kTilesInt8: tiled_nibble_int8_linear_out(out, x, weight, bias); return;  // their prompt rows' int8 path
      case Kind::kQ8: q8_linear_out(out, x, weight, scales, bias); return;
      case Kind::kBf16: bf16_linear_out(out, x, weight, bias); return;  // kvserve.quant.Bf16Linear, packed for kvserve's kernel
      case Kind::kW8A8:  // kvserve.quant.W8A8Linear (extra: its panels' largest codes)
        w8a8_linear_out(out, x, weight, scales, bias, extra.defined() ? c10::optional<torch::Tensor>(extra) : c10::nullopt);
        return;
      case Kind::kFp32: fp32_linear_out(out, x, weight, bias); return;  // kvserve.quant.Fp32Linear
      case Kind::kSegments: {  // each segment straight into its own columns (the kernels take a row stride)
        int64_t column = 0;
        for (const Linear& segment : segments) {
          segment.into(out.narrow(1, column, segment.out_features), x);
          column += segment.out_features;
        }
        return;
      }
      default: out.copy_(computed(x)); return;
    }
  }

 private:
  // The kinds whose kernels write into a given output; the others return a tensor of their own.
  bool writes_in_place() const {
    return kind == Kind::kQ4 || kind == Kind::kQ5 || kind == Kind::kTiles || kind == Kind::kTilesInt8 || kind == Kind::kQ8 ||
           kind == Kind::kBf16 || kind == Kind::kW8A8 || kind == Kind::kFp32 || kind == Kind::kSegments;
  }

  torch::Tensor computed(const torch::Tensor& x) const {
    switch (kind) {
      case Kind::kOneDnnBf16: {
        // kvserve.quant.Bf16Linear: oneDNN's pre-packed bf16 matmul, called as Python calls it.
        static const c10::OperatorHandle op =
            c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        std::vector<c10::IValue> stack{x.to(weight.scalar_type()), weight,
                                       bias ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                                       c10::List<c10::optional<c10::Scalar>>(), c10::IValue(std::string(""))};
        op.callBoxed(&stack);
        return stack[0].toTensor().to(x.scalar_type());
      }
      case Kind::kInt8: {  // kvserve.quant.Int8Linear: torch's per-channel int8 kernel
        auto y = at::_weight_int8pack_mm(x.to(scales.scalar_type()), weight, scales);
        if (bias) y = y + *bias;
        return y.to(x.scalar_type());
      }
      case Kind::kDense:
      default:
        return at::linear(x.to(weight.scalar_type()), weight, bias).to(x.scalar_type());
    }
  }
};

Linear make_linear(const pybind11::tuple& spec) {
  Linear linear;
  const auto kind = spec[0].cast<std::string>();
  if (!spec[1].is_none()) linear.weight = spec[1].cast<torch::Tensor>();
  if (!spec[2].is_none()) linear.scales = spec[2].cast<torch::Tensor>();
  if (!spec[3].is_none()) linear.bias = spec[3].cast<torch::Tensor>();
  linear.out_features = spec.size() > 4 && !spec[4].is_none() ? spec[4].cast<int64_t>() : linear.weight.size(0);
  if (spec.size() > 5 && !spec[5].is_none())
    linear.prefill = std::make_shared<const Linear>(make_linear(spec[5].cast<pybind11::tuple>()));
  if (spec.size() > 6 && !spec[6].is_none()) linear.extra = spec[6].cast<torch::Tensor>();
  if (spec.size() > 7 && !spec[7].is_none())
    for (const auto& part : spec[7].cast<pybind11::list>()) linear.segments.push_back(make_linear(part.cast<pybind11::tuple>()));
  if (kind == "q4") linear.kind = Linear::Kind::kQ4;
  else if (kind == "q5") linear.kind = Linear::Kind::kQ5;
  else if (kind == "tiles") linear.kind = Linear::Kind::kTiles;
  else if (kind == "tiles_int8") linear.kind = Linear::Kind::kTilesInt8;
  else if (kind == "segments") linear.kind = Linear::Kind::kSegments;
  else if (kind == "bf16") linear.kind = Linear::Kind::kBf16;
  else if (kind == "w8a8") linear.kind = Linear::Kind::kW8A8;
  else if (kind == "fp32") linear.kind = Linear::Kind::kFp32;
  else if (kind == "q8") linear.kind = Linear::Kind::kQ8;
  else if (kind == "onednn_bf16") linear.kind = Linear::Kind::kOneDnnBf16;
  else if (kind == "int8") linear.kind = Linear::Kind::kInt8;
  else if (kind == "dense") linear.kind = Linear::Kind::kDense;
  else TORCH_CHECK(false, "unknown linear kind ", kind);
  return linear;
}

c10::optional<torch::Tensor> optional_tensor(const pybind11::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return c10::nullopt;
  return d[key].cast<torch::Tensor>();
}

// x += y for [T, n] tensors with contiguous rows: the residual adds, without a trip through
// the dispatcher per layer (the same IEEE sums as torch's add_), rows spread over the threads as
// rms_norm spreads them (a decode's one row stays on this thread).
void add_rows_(const torch::Tensor& x, const torch::Tensor& y) {
  const int64_t n = x.size(1), x_stride = x.stride(0), y_stride = y.stride(0);
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  kvserve::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * x_stride;
      const float* yr = yp + r * y_stride;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) xr[i] += yr[i];
    }
  });
}

// The roles of `rows` of the step (sorted, distinct), renumbered 0.. in their order
// (TokenRoles.subset in kvserve/token_roles.py): the last layer's rows past its attention.
TokenRoles roles_of_rows(const TokenRoles& roles, const torch::Tensor& rows) {
  if (roles.kind != TokenRoles::Kind::kMixed) return roles;
  const int64_t n = rows.numel(), num_prompt = roles.prompt_rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* prompt_rows = roles.prompt_rows.data_ptr<int64_t>();
  std::vector<int64_t> prompt, generated;
  for (int64_t i = 0, j = 0; i < n; ++i) {
    while (j < num_prompt && prompt_rows[j] < r[i]) ++j;
    (j < num_prompt && prompt_rows[j] == r[i] ? prompt : generated).push_back(i);
  }
  TokenRoles out;
  out.kind = prompt.empty()      ? TokenRoles::Kind::kAllGenerated
             : generated.empty() ? TokenRoles::Kind::kAllPrompt
                                 : TokenRoles::Kind::kMixed;
  if (out.kind != TokenRoles::Kind::kMixed) return out;
  out.prompt_rows = torch::tensor(prompt, torch::kInt64);
  out.generated_rows = torch::tensor(generated, torch::kInt64);
  std::tie(out.prompt_start, out.prompt_len) = row_run(out.prompt_rows);
  std::tie(out.generated_start, out.generated_len) = row_run(out.generated_rows);
  return out;
}

// Rows `rows` (ascending, distinct) of x [T, n] (contiguous rows) moved to its first rows, in
// their order: row rows[j] >= j is read before any write reaches it.
void compact_rows_(const torch::Tensor& x, const torch::Tensor& rows) {
  const int64_t n = x.size(1), stride = x.stride(0), count = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  float* p = x.data_ptr<float>();
  for (int64_t j = 0; j < count; ++j)
    if (r[j] != j) std::copy(p + r[j] * stride, p + r[j] * stride + n, p + j * stride);
}

// A step's activations past a layer's attention, [rows, columns] each.
struct LayerRows {
  torch::Tensor hidden, attn, normed, projected, gate_up, activated;
  LayerRows first(int64_t rows) const {
    return {hidden.narrow(0, 0, rows),    attn.narrow(0, 0, rows),    normed.narrow(0, 0, rows),
            projected.narrow(0, 0, rows), gate_up.narrow(0, 0, rows), activated.narrow(0, 0, rows)};
  }
};

// `n` first rows of a step's buffer (itself when it has n: a decode step's single row makes no view).
torch::Tensor first_rows(const torch::Tensor& buffer, int64_t n) {
  return n == buffer.size(0) ? buffer : buffer.narrow(0, 0, n);
}

// One expert call's activations: its rows' inputs (gathered where they are not one run of the
// step's), gate_up, activated and output rows.
struct ExpertBuffers {
  torch::Tensor gathered, gate_up, activated, output;  // [T, H], [T, 2 I], [T, I], [T, H]
};

// A step's scratch for its routed-experts layers, made once per step (T: the step's rows).
struct ExpertScratch {
  torch::Tensor logits, products;                                // [T, E], [T k, H]
  std::vector<ExpertBuffers> buffers;                            // one per thread running experts at once
  std::vector<float> weights, pair_weights;                      // [T k]
  std::vector<int64_t> experts, pair_rows, pair_slots, starts;  // [T k] ..., [E + 1]
};

// Steps of at most this many rows spread their experts over the threads (each expert's calls
// on one thread); larger ones run the experts one after another, each split over the threads by
// its kernels. A decode step's expert is a few small GEMVs: at Qwen3-30B-A3B's shape read at
// full bandwidth either way, but at a small width each falls under the kernels' one-thread
// threshold (dense_linear.cpp's kSmallWork) and the other threads would idle. Each output row
// is computed whole by one thread either way: the same bits. (A global, as the kernels' route
// switches: benchmarks compare the two; 0: always one after another.)
int64_t g_expert_parallel_rows = 16;

// Routed experts in place of a layer's MLP (Qwen3-MoE's softmax top-k): the steps of
// models/qwen3_moe.py's SparseMoEBlock and models/moe.py's run_routed_experts, in their order,
// on the same kernels. The router's exact logits; the routing kernel the Python model calls
// (moe_routing.cpp); each token's k choices in ascending expert order; then each expert that
// has tokens on its tokens' rows only (ascending; gathered where they are not one run), through
// the same Linear calls as a dense MLP, its output rows times their weights into their (token,
// choice) slots; each token's k slots added in ascending expert order. An expert no token
// chose is never read.
struct RoutedExperts {
  Linear router;
  std::vector<Linear> gate_up, down;  // per expert
  int64_t top_k = 1;
  bool normalize = false;
  bool kernels_only = false;  // every expert's linears run kvserve's kernels (may run on any thread)

  int64_t num_experts() const { return static_cast<int64_t>(gate_up.size()); }

  bool team_safe() const { return router.team_safe() && kernels_only; }

  // The scratch of a step of `rows` rows: buffers for as many experts at once as there are threads
  // where such a step spreads its experts over them.
  ExpertScratch scratch(int64_t rows, int64_t hidden_size, const torch::TensorOptions& options) const {
    const int64_t E = num_experts(), width = gate_up.front().out_features, pairs = rows * top_k;
    const auto buffer = [&](int64_t n, int64_t columns) { return torch::empty({n, columns}, options); };
    ExpertScratch s{buffer(rows, E), buffer(pairs, hidden_size), {}, std::vector<float>(pairs),
                    std::vector<float>(pairs), std::vector<int64_t>(pairs), std::vector<int64_t>(pairs),
                    std::vector<int64_t>(pairs), std::vector<int64_t>(E + 1)};
    const int64_t sets = in_parallel(rows) ? at::get_num_threads() : 1;
    for (int64_t i = 0; i < sets; ++i)
      s.buffers.push_back({buffer(rows > 1 ? rows : 0, hidden_size), buffer(rows, width), buffer(rows, width / 2),
                           buffer(rows, hidden_size)});
    return s;
  }

  // out [R, hidden] <- the block's output for x [R, hidden] (both with contiguous rows), whose rows
  // have the roles `roles`.
  void into(const torch::Tensor& out, const torch::Tensor& x, const TokenRoles& roles, int64_t activation,
            ExpertScratch& s) const {
    const int64_t R = x.size(0), E = num_experts(), k = top_k;
    if (R == 0) return;
    float* weights = s.weights.data();
    int64_t* experts = s.experts.data();
    {
      RECORD_FUNCTION("router", std::vector<c10::IValue>());  // (kvserve profile's rows, as the modules' labels)
      const auto logits = first_rows(s.logits, R);
      router.into(logits, x, roles);
      softmax_top_k_rows(logits.data_ptr<float>(), R, E, k, normalize, weights, experts);
    }
    RECORD_FUNCTION("experts", std::vector<c10::IValue>());
    for (int64_t t = 0; t < R; ++t) {  // (a token's ids are distinct: an insertion sort keeps the pairs)
      int64_t* ids = experts + t * k;
      float* w = weights + t * k;
      for (int64_t j = 1; j < k; ++j) {
        for (int64_t i = j; i > 0 && ids[i - 1] > ids[i]; --i) {
          std::swap(ids[i - 1], ids[i]);
          std::swap(w[i - 1], w[i]);
        }
      }
    }
    // The (token, choice) pairs grouped by expert, tokens ascending within one (a counting sort of
    // the token-major pairs: the stable argsort run_routed_experts takes).
    int64_t* starts = s.starts.data();
    std::fill(s.starts.begin(), s.starts.end(), 0);
    for (int64_t p = 0; p < R * k; ++p) ++starts[experts[p] + 1];
    for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
    std::vector<int64_t> next(starts, starts + E), active;
    for (int64_t p = 0; p < R * k; ++p) {
      const int64_t q = next[experts[p]]++;
      s.pair_rows[q] = p / k;
      s.pair_slots[q] = p;
      s.pair_weights[q] = weights[p];
    }
    for (int64_t e = 0; e < E; ++e)
      if (starts[e + 1] > starts[e]) active.push_back(e);
    const int64_t num_active = static_cast<int64_t>(active.size());
    const int64_t parts = in_parallel(R) && roles.kind != TokenRoles::Kind::kMixed
                              ? std::min<int64_t>(num_active, static_cast<int64_t>(s.buffers.size()))
                              : 1;
    if (parts > 1) {
      kvserve::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t i = num_active * p / parts; i < num_active * (p + 1) / parts; ++i)
            run_expert(active[i], x, roles, activation, s, s.buffers[p]);
      });
    } else {
      for (const int64_t e : active) run_expert(e, x, roles, activation, s, s.buffers.front());
    }
    // Each token's k products added in ascending expert order, one add at a time (torch's
    // `out + per_pair[:, j]` in run_routed_experts, the same IEEE sums).
    const int64_t H = x.size(1), o_stride = out.stride(0);
    const float* products = s.products.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t t = 0; t < R; ++t) {
      float* ot = o + t * o_stride;
      const float* pt = products + t * k * H;
      std::copy(pt, pt + H, ot);
      for (int64_t j = 1; j < k; ++j) {
        const float* pj = pt + j * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) ot[h] += pj[h];
      }
    }
  }

 private:
  bool in_parallel(int64_t rows) const { return kernels_only && rows <= g_expert_parallel_rows; }

  // Expert e on its rows of x (s's pairs from starts[e]), in `b`: its products, each output row
  // times its weight, into the rows of s.products its (token, choice) pairs name.
  void run_expert(int64_t e, const torch::Tensor& x, const TokenRoles& roles, int64_t activation,
                  const ExpertScratch& s, const ExpertBuffers& b) const {
    const int64_t R = x.size(0), H = x.size(1), start = s.starts[e], count = s.starts[e + 1] - start;
    const int64_t* rows = s.pair_rows.data() + start;
    torch::Tensor input = x;  // (count == R: every row, in order)
    if (count < R && rows[count - 1] - rows[0] + 1 == count) {
      input = x.narrow(0, rows[0], count);
    } else if (count < R) {
      input = first_rows(b.gathered, count);
      const int64_t x_stride = x.stride(0);
      const float* xp = x.data_ptr<float>();
      float* g = input.data_ptr<float>();
      for (int64_t i = 0; i < count; ++i) std::copy(xp + rows[i] * x_stride, xp + rows[i] * x_stride + H, g + i * H);
    }
    const TokenRoles expert_roles =
        roles.kind == TokenRoles::Kind::kMixed
            ? roles_of_rows(roles, torch::from_blob(const_cast<int64_t*>(rows), {count}, torch::kInt64))
            : roles;
    const auto hidden_gate_up = first_rows(b.gate_up, count), activated = first_rows(b.activated, count),
               y = first_rows(b.output, count);
    gate_up[e].into(hidden_gate_up, input, expert_roles);
    act_and_mul_out(activated, hidden_gate_up, activation);
    down[e].into(y, activated, expert_roles);
    const float* yp = y.data_ptr<float>();
    float* products = s.products.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      const float w = s.pair_weights[start + i];
      const float* src = yp + i * H;
      float* dst = products + s.pair_slots[start + i] * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * w;
    }
  }
};

std::shared_ptr<const RoutedExperts> make_routed_experts(const pybind11::dict& spec) {
  auto experts = std::make_shared<RoutedExperts>();
  experts->router = make_linear(spec["router"].cast<pybind11::tuple>());
  for (const auto& args : spec["experts_gate_up"].cast<pybind11::list>())
    experts->gate_up.push_back(make_linear(args.cast<pybind11::tuple>()));
  for (const auto& args : spec["experts_down"].cast<pybind11::list>())
    experts->down.push_back(make_linear(args.cast<pybind11::tuple>()));
  experts->top_k = spec["top_k"].cast<int64_t>();
  experts->normalize = spec["normalize"].cast<bool>();
  const int64_t E = experts->num_experts();
  TORCH_CHECK(E >= 1 && static_cast<int64_t>(experts->down.size()) == E && experts->router.out_features == E,
              "routed experts need one router row, one gate_up and one down projection per expert");
  TORCH_CHECK(experts->top_k >= 1 && experts->top_k <= E, "routed experts take 1 <= k <= ", E, " per token, not ",
              experts->top_k);
  for (const Linear& linear : experts->gate_up)
    TORCH_CHECK(linear.out_features == experts->gate_up.front().out_features && linear.out_features % 2 == 0,
                "every expert must have the same (even) gate_up width");
  const auto kernels_only = [](const std::vector<Linear>& linears) {
    return std::all_of(linears.begin(), linears.end(), [](const Linear& l) { return l.team_safe(); });
  };
  experts->kernels_only = kernels_only(experts->gate_up) && kernels_only(experts->down);
  return experts;
}

struct Layer {
  torch::Tensor input_norm, pre_ffn_norm;
  c10::optional<torch::Tensor> post_attn_norm, post_ffn_norm, q_norm, k_norm;  // Gemma's extra norms
  Linear qkv, o, gate_up, down;  // (gate_up, down: a dense MLP's)
  std::shared_ptr<const RoutedExperts> experts;  // routed experts in place of the dense MLP, or null
  double scale = 1.0, softcap = 0.0;
  int64_t window = 0;
  bool local_rope = false;  // Gemma 3: sliding layers have their own rope base

  bool team_safe() const {
    const bool mlp_safe = experts ? experts->team_safe() : gate_up.team_safe() && down.team_safe();
    return qkv.team_safe() && o.team_safe() && mlp_safe;
  }
};

}  // namespace

class FusedDecoderLayers::Impl {
 public:
  Impl(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double norm_offset,
                     int64_t activation, const std::vector<pybind11::dict>& layers)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        norm_offset_(norm_offset), activation_(activation) {
    for (const auto& spec : layers) {
      Layer layer;
      layer.input_norm = spec["input_norm"].cast<torch::Tensor>();
      layer.pre_ffn_norm = spec["pre_ffn_norm"].cast<torch::Tensor>();
      layer.post_attn_norm = optional_tensor(spec, "post_attn_norm");
      layer.post_ffn_norm = optional_tensor(spec, "post_ffn_norm");
      layer.q_norm = optional_tensor(spec, "q_norm");
      layer.k_norm = optional_tensor(spec, "k_norm");
      layer.qkv = make_linear(spec["qkv"].cast<pybind11::tuple>());
      layer.o = make_linear(spec["o"].cast<pybind11::tuple>());
      if (spec.contains("router")) {
        layer.experts = make_routed_experts(spec);
      } else {
        layer.gate_up = make_linear(spec["gate_up"].cast<pybind11::tuple>());
        layer.down = make_linear(spec["down"].cast<pybind11::tuple>());
      }
      layer.scale = spec["scale"].cast<double>();
      layer.window = spec["window"].cast<int64_t>();
      layer.softcap = spec["softcap"].cast<double>();
      layer.local_rope = spec["local_rope"].cast<bool>();
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(!layers_.empty(), "a decoder needs at least one layer");
    // The step's buffers are shared by its layers: the dense MLPs' one width, the routed experts' one shape.
    for (const Layer& layer : layers_) {
      if (layer.experts && !experts_) experts_ = layer.experts;
      if (!layer.experts && dense_width_ < 0) dense_width_ = layer.gate_up.out_features;
    }
    dense_width_ = std::max<int64_t>(dense_width_, 0);
    for (const Layer& layer : layers_) {
      const RoutedExperts* e = layer.experts.get();
      TORCH_CHECK(layer.qkv.out_features == layers_.front().qkv.out_features &&
                      (e ? e->num_experts() == experts_->num_experts() && e->top_k == experts_->top_k &&
                               e->gate_up.front().out_features == experts_->gate_up.front().out_features
                         : layer.gate_up.out_features == dense_width_ && dense_width_ % 2 == 0),
                  "every layer must have the same projection shapes (the step's buffers are shared)");
    }
    team_safe_ = std::all_of(layers_.begin(), layers_.end(), [](const Layer& layer) { return layer.team_safe(); });
  }

  // forward from the step's tokens: hidden = the embedding rows of input_ids (an fp32 table, or
  // its Q8_0 blocks with embed_scales: row_table.h), times embed_scale unless it is 1 (Gemma's
  // normalizer, an fp32 product as torch's), and each rope
  // table's rows at the step's positions ([n, D] tables of positions 0 .. n - 1, from
  // RopeFrequencies.tables; the local ones may be the same tensors). The same values as the
  // model's embedding, scale and index_select in Python, without their dispatch each step.
  torch::Tensor forward_tokens(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& embed_weight, const c10::optional<torch::Tensor>& embed_scales,
                               double embed_scale, const torch::Tensor& cos_table,
                               const torch::Tensor& sin_table, const torch::Tensor& local_cos_table,
                               const torch::Tensor& local_sin_table, const std::vector<torch::Tensor>& kv_caches,
                               const std::vector<torch::Tensor>& kv_scales, const std::vector<int64_t>& kv_groups,
                               const std::vector<torch::Tensor>& slot_mappings,
                               const std::vector<torch::Tensor>& block_tables, torch::Tensor seq_lens,
                               const torch::Tensor& query_start_loc, int64_t roles_kind,
                               c10::optional<torch::Tensor> prompt_rows,
                               c10::optional<torch::Tensor> generated_rows,
                               c10::optional<torch::Tensor> output_rows) const {
    TORCH_CHECK(input_ids.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 &&
                    input_ids.dim() == 1 && input_ids.is_contiguous() && positions.is_contiguous() &&
                    positions.numel() == input_ids.numel(),
                "input_ids and positions must be contiguous int64 [T]");
    const RowTable table(embed_weight, embed_scales, "the embedding");
    const int64_t T = input_ids.numel(), vocab = table.rows(), hidden_size = table.width();
    auto hidden = torch::empty({T, hidden_size}, input_ids.options().dtype(torch::kFloat32));
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    float* h = hidden.data_ptr<float>();
    const float scale = static_cast<float>(embed_scale);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " is outside the vocabulary of ", vocab);
      float* out = h + t * hidden_size;
      const float* row = table.row(ids[t], out);
      if (scale == 1.f) {
        if (row != out) std::copy(row, row + hidden_size, out);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden_size; ++i) out[i] = row[i] * scale;
      }
    }
    const auto rows = [&](const torch::Tensor& rope_table) {
      TORCH_CHECK(rope_table.scalar_type() == torch::kFloat32 && rope_table.dim() == 2 && rope_table.is_contiguous() &&
                      rope_table.size(1) == head_dim_,
                  "rope tables must be contiguous float32 [positions, head_dim]");
      auto out = torch::empty({T, head_dim_}, rope_table.options());
      const int64_t* pos = positions.data_ptr<int64_t>();
      const float* rope = rope_table.data_ptr<float>();
      float* o = out.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < rope_table.size(0), "position ", pos[t], " is past the rope table's ",
                    rope_table.size(0));
        std::copy(rope + pos[t] * head_dim_, rope + (pos[t] + 1) * head_dim_, o + t * head_dim_);
      }
      return out;
    };
    // paged_attention's per-sequence rows (kvserve.attention.kernel_rows): sequence i, its
    // first query row and its number of queries, from the step's query_start_loc [S + 1].
    TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.dim() == 1 &&
                    query_start_loc.is_contiguous() && query_start_loc.numel() >= 1,
                "query_start_loc must be a contiguous int32 [S + 1]");
    const int64_t S = query_start_loc.numel() - 1;
    const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
    const auto index_options = torch::TensorOptions().dtype(torch::kInt64);
    auto seq_ids = torch::empty({S}, index_options), query_starts = torch::empty({S}, index_options),
         query_lens = torch::empty({S}, index_options);
    int64_t *ids_out = seq_ids.data_ptr<int64_t>(), *starts_out = query_starts.data_ptr<int64_t>(),
            *lens_out = query_lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < S; ++i) {
      ids_out[i] = i;
      starts_out[i] = qsl[i];
      lens_out[i] = qsl[i + 1] - qsl[i];
    }
    const auto cos = rows(cos_table), sin = rows(sin_table);
    const bool shared = local_cos_table.is_same(cos_table) && local_sin_table.is_same(sin_table);
    const auto local_cos = shared ? cos : rows(local_cos_table), local_sin = shared ? sin : rows(local_sin_table);
    return forward(hidden, cos, sin, local_cos, local_sin, kv_caches, kv_scales, kv_groups, slot_mappings, block_tables,
                   seq_lens, seq_ids, query_starts, query_lens, roles_kind, prompt_rows, generated_rows, output_rows);
  }

  // `num_steps` greedy decode steps for rows that are one decode each and read only the argmax
  // (kvserve.runner's argmax-only decode steps, alone or as a multi-step round): the first on the
  // inputs as the caller prepared them; before each later one every row's last token is fed back
  // one position on (input_ids, positions, each group's slot from its block table, seq_lens: the
  // caller's tensors, advanced in place). Each step is forward_tokens, the final norm and the LM
  // head's argmax screen with its argmax (screened_argmax_out, `logits` its scratch): the native
  // calls the Python path makes per step, in its order, so the same tokens and the same KV,
  // without a return to Python between or around them (~0.4 ms a step of a single int4 SmolLM2
  // stream, mostly dispatch slowed by caches the weights evicted). Returns the tokens [steps, S].
  torch::Tensor decode_round(int64_t num_steps, const torch::Tensor& input_ids,
                             const torch::Tensor& positions, int64_t block_size, const torch::Tensor& embed_weight,
                             const c10::optional<torch::Tensor>& embed_scales, double embed_scale,
                             const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                             const torch::Tensor& local_cos_table, const torch::Tensor& local_sin_table,
                             const std::vector<torch::Tensor>& kv_caches, const std::vector<torch::Tensor>& kv_scales,
                             const std::vector<int64_t>& kv_groups, const std::vector<torch::Tensor>& slot_mappings,
                             const std::vector<torch::Tensor>& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& query_start_loc, const torch::Tensor& norm_weight, double norm_eps,
                             double norm_offset, const torch::Tensor& screen, const torch::Tensor& exact,
                             const c10::optional<torch::Tensor>& exact_scales, int64_t top_k,
                             const torch::Tensor& logits) const {
    const int64_t S = input_ids.numel();
    TORCH_CHECK(num_steps >= 0 && block_size > 0, "num_steps >= 0, block_size > 0");
    TORCH_CHECK(input_ids.scalar_type() == torch::kInt64 && input_ids.is_contiguous() &&
                    positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == S &&
                    query_start_loc.numel() == S + 1 && seq_lens.numel() == S &&
                    seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
                "a round's rows are one decode each: input_ids, positions (int64), seq_lens (int32) [S], "
                "query_start_loc [S + 1]");
    const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
    for (int64_t s = 0; s <= S; ++s) TORCH_CHECK(qsl[s] == s, "a round's rows are one decode each");
    for (size_t g = 0; g < slot_mappings.size(); ++g)
      TORCH_CHECK(slot_mappings[g].scalar_type() == torch::kInt64 && slot_mappings[g].is_contiguous() &&
                      slot_mappings[g].numel() == S && block_tables[g].scalar_type() == torch::kInt32 &&
                      block_tables[g].dim() == 2 && block_tables[g].size(0) == S && block_tables[g].is_contiguous(),
                  "slot mappings int64 [S], block tables contiguous int32 [S, blocks]");
    auto tokens = torch::empty({num_steps, S}, input_ids.options());
    int64_t* ids = input_ids.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();
    int32_t* lens = seq_lens.data_ptr<int32_t>();
    int64_t* sampled = tokens.data_ptr<int64_t>();
    // The round's steps in one parallel region (the head's screen and the argmax included),
    // where its layers would run in one each; without the GIL, which forward would otherwise
    // take back at every step inside the region while the team's helpers wait.
    pybind11::gil_scoped_release no_gil;
    const auto run_round = [&] {
      for (int64_t step = 0; step < num_steps; ++step) {
        for (int64_t s = 0; step > 0 && s < S; ++s) {  // (the first step runs on the inputs as prepared)
          ids[s] = sampled[(step - 1) * S + s];
          pos[s] += 1;
          lens[s] += 1;
          for (size_t g = 0; g < slot_mappings.size(); ++g) {
            const int64_t block = pos[s] / block_size, num_blocks = block_tables[g].size(1);
            TORCH_CHECK(block < num_blocks, "position ", pos[s], " is past the round's lookahead slots");
            slot_mappings[g].data_ptr<int64_t>()[s] =
                static_cast<int64_t>(block_tables[g].data_ptr<int32_t>()[s * num_blocks + block]) * block_size +
                pos[s] % block_size;
          }
        }
        const auto hidden = forward_tokens(input_ids, positions, embed_weight, embed_scales, embed_scale, cos_table,
                                           sin_table, local_cos_table, local_sin_table, kv_caches, kv_scales,
                                           kv_groups, slot_mappings, block_tables, seq_lens, query_start_loc, 0,
                                           c10::nullopt, c10::nullopt, c10::nullopt);
        screened_argmax_out(tokens[step], logits, rms_norm(hidden, norm_weight, norm_eps, norm_offset), screen, exact,
                            exact_scales, top_k);
      }
    };
    kvserve::run_in_step_team(run_round, team_safe_);
    return tokens;
  }

  size_t num_layers() const { return layers_.size(); }
  // Whether a step's layers run as one parallel region (every linear on kvserve's kernels).
  bool team_safe() const { return team_safe_; }

 private:
  // hidden [T, hidden] (this step's embeddings, consumed) -> the last layer's output (pre final norm)
  // for output_rows of the step (ascending, distinct; none: every row; models/base.py's
  // last_layer_rows: past the last layer's attention, a row only feeds its own logits).
  // rope tables [T, D] for global and local layers; attention metadata as paged_attention's.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor local_cos,
                        torch::Tensor local_sin, const std::vector<torch::Tensor>& kv_caches,
                        const std::vector<torch::Tensor>& kv_scales, const std::vector<int64_t>& kv_groups,
                        const std::vector<torch::Tensor>& slot_mappings, const std::vector<torch::Tensor>& block_tables,
                        torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor query_starts,
                        torch::Tensor query_lens, int64_t roles_kind, c10::optional<torch::Tensor> prompt_rows,
                        c10::optional<torch::Tensor> generated_rows, c10::optional<torch::Tensor> output_rows) const {
    // KV cache groups (kvserve/kv_cache.py): layer i writes and reads its cache through the slot
    // mapping and block tables of its group kv_groups[i] (sliding-window groups hold fewer blocks).
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(kv_scales.empty() || kv_scales.size() == layers_.size(), "one KV scale tensor per layer, or none");
    TORCH_CHECK(kv_groups.size() == layers_.size() && slot_mappings.size() == block_tables.size(),
                "one KV cache group per layer, one slot mapping and block table per group");
    for (const int64_t g : kv_groups)
      TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(block_tables.size()), "KV cache group out of range");
    const int64_t T = hidden.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    TORCH_CHECK(roles_kind >= 0 && roles_kind <= 2, "token roles kind out of range");
    TokenRoles roles;
    roles.kind = static_cast<TokenRoles::Kind>(roles_kind);
    if (roles.kind == TokenRoles::Kind::kMixed) {
      TORCH_CHECK(prompt_rows && generated_rows && prompt_rows->scalar_type() == torch::kInt64 &&
                      generated_rows->scalar_type() == torch::kInt64 && prompt_rows->is_contiguous() &&
                      generated_rows->is_contiguous() && prompt_rows->numel() + generated_rows->numel() == T,
                  "a mixed step needs the int64 rows of both roles, together the step's rows");
      roles.prompt_rows = *prompt_rows;
      roles.generated_rows = *generated_rows;
      std::tie(roles.prompt_start, roles.prompt_len) = row_run(roles.prompt_rows);
      std::tie(roles.generated_start, roles.generated_len) = row_run(roles.generated_rows);
    }
    int64_t num_output_rows = T;
    if (output_rows) {
      TORCH_CHECK(output_rows->scalar_type() == torch::kInt64 && output_rows->dim() == 1 &&
                      output_rows->is_contiguous() && output_rows->device().is_cpu() && output_rows->numel() <= T,
                  "output_rows must be a contiguous int64 CPU tensor [R <= T]");
      num_output_rows = output_rows->numel();
      const int64_t* r = output_rows->data_ptr<int64_t>();
      for (int64_t j = 0; j < num_output_rows; ++j)
        TORCH_CHECK(r[j] >= (j ? r[j - 1] + 1 : 0) && r[j] < T, "output_rows must be ascending, distinct rows of the step");
    }
    const TokenRoles output_roles = output_rows ? roles_of_rows(roles, *output_rows) : roles;
    hidden = hidden.contiguous();  // the residual stream, updated in place (the caller's fresh embeddings)
    // Every layer has the same shapes, so the step's intermediates (and the q/k/v views of
    // the projection) are made once and reused by each layer in turn: per layer they were a
    // dozen allocations and views through the dispatcher, ~1 ms of a 30-layer decode step.
    const int64_t hidden_size = hidden.size(1);
    const auto buffer = [&](int64_t columns) { return torch::empty({T, columns}, hidden.options()); };
    const Layer& first = layers_.front();
    auto normed = buffer(hidden_size), projected = buffer(hidden_size), qkv = buffer(first.qkv.out_features),
         attn = buffer(H * D), gate_up = buffer(dense_width_), activated = buffer(dense_width_ / 2);
    ExpertScratch expert_scratch = experts_ ? experts_->scratch(T, hidden_size, hidden.options()) : ExpertScratch{};
    const auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
    const auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
    const auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    const auto attn_heads = attn.view({T, H, D});
    const LayerRows every_row{hidden, attn, normed, projected, gate_up, activated};
    // The last layer's rows past attention: views made here, before the step team (a decode's
    // step, every row wanted, makes none).
    const LayerRows output_rows_first = output_rows ? every_row.first(num_output_rows) : every_row;
    std::optional<pybind11::gil_scoped_release> no_gil;  // (decode_round's steps come without it)
    if (PyGILState_Check()) no_gil.emplace();
    // One parallel region for the step's layers where every call is one of kvserve's kernels (a
    // mixed step's role that is not one run of rows is gathered by torch ops).
    const auto gathers_rows = [](const TokenRoles& r) {
      return r.kind == TokenRoles::Kind::kMixed && (r.prompt_len == 0 || r.generated_len == 0);
    };
    // (an expert's rows of a mixed step may hold its roles in several runs)
    const bool gathers = gathers_rows(roles) || gathers_rows(output_roles) ||
                         (experts_ && roles.kind == TokenRoles::Kind::kMixed);
    // The layer past its attention, on rows whose attention output is in `rows.attn`.
    const auto finish_layer = [&](const Layer& layer, const LayerRows& rows, const TokenRoles& rows_roles) {
      layer.o.into(rows.projected, rows.attn, rows_roles);
      if (layer.post_attn_norm) rms_norm_out(rows.projected, rows.projected, *layer.post_attn_norm, eps_, norm_offset_);
      add_rows_(rows.hidden, rows.projected);
      rms_norm_out(rows.normed, rows.hidden, layer.pre_ffn_norm, eps_, norm_offset_);
      if (layer.experts) {
        layer.experts->into(rows.projected, rows.normed, rows_roles, activation_, expert_scratch);
      } else {
        layer.gate_up.into(rows.gate_up, rows.normed, rows_roles);
        act_and_mul_out(rows.activated, rows.gate_up, activation_);
        layer.down.into(rows.projected, rows.activated, rows_roles);
      }
      if (layer.post_ffn_norm) rms_norm_out(rows.projected, rows.projected, *layer.post_ffn_norm, eps_, norm_offset_);
      add_rows_(rows.hidden, rows.projected);
    };
    const auto run_layers = [&] {
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        rms_norm_out(normed, hidden, layer.input_norm, eps_, norm_offset_);
        layer.qkv.into(qkv, normed, roles);
        rope_qk_(qkv, layer.local_rope ? local_cos : cos, layer.local_rope ? local_sin : sin, H, KVH, D,
                 layer.q_norm, layer.k_norm, eps_, norm_offset_);
        {
          RECORD_FUNCTION("attention", std::vector<c10::IValue>());  // the label kvserve profile counts
          const c10::optional<torch::Tensor> scales =
              kv_scales.empty() ? c10::nullopt : c10::optional<torch::Tensor>(kv_scales[i]);
          const auto group = kv_groups[i];
          write_kv_cache(k, v, kv_caches[i], scales, slot_mappings[group]);
          paged_attention(attn_heads, q, kv_caches[i], scales, block_tables[group], seq_lens, seq_ids, query_starts,
                          query_lens, layer.scale, layer.window, layer.softcap);
        }
        if (i + 1 < layers_.size() || !output_rows) {
          finish_layer(layer, every_row, roles);
        } else {
          compact_rows_(attn, *output_rows);
          compact_rows_(hidden, *output_rows);
          if (num_output_rows) finish_layer(layer, output_rows_first, output_roles);
        }
      }
    };
    kvserve::run_in_step_team(run_layers, team_safe_ && !gathers);
    return output_rows_first.hidden;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, norm_offset_;
  int64_t activation_;
  std::vector<Layer> layers_;
  int64_t dense_width_ = -1;  // the dense MLPs' gate_up width (0: none)
  std::shared_ptr<const RoutedExperts> experts_;  // a routed-experts layer's shapes (null: none)
  bool team_safe_ = false;  // every layer's linears run kvserve's kernels (Linear::team_safe)
};

void set_expert_parallel_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "expert_parallel_rows must be >= 0");
  g_expert_parallel_rows = rows;
}

int64_t expert_parallel_rows() { return g_expert_parallel_rows; }

FusedDecoderLayers::FusedDecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                       double norm_offset, int64_t activation,
                                       const std::vector<pybind11::dict>& layers)
    : impl_(std::make_unique<Impl>(num_heads, num_kv_heads, head_dim, eps, norm_offset, activation, layers)) {}

FusedDecoderLayers::~FusedDecoderLayers() = default;

torch::Tensor FusedDecoderLayers::forward_tokens(
    const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& embed_weight,
    const c10::optional<torch::Tensor>& embed_scales, double embed_scale, const torch::Tensor& cos_table,
    const torch::Tensor& sin_table, const torch::Tensor& local_cos_table, const torch::Tensor& local_sin_table,
    const std::vector<torch::Tensor>& kv_caches, const std::vector<torch::Tensor>& kv_scales,
    const std::vector<int64_t>& kv_groups, const std::vector<torch::Tensor>& slot_mappings,
    const std::vector<torch::Tensor>& block_tables, torch::Tensor seq_lens, const torch::Tensor& query_start_loc,
    int64_t roles_kind, c10::optional<torch::Tensor> prompt_rows, c10::optional<torch::Tensor> generated_rows,
    c10::optional<torch::Tensor> output_rows) const {
  return impl_->forward_tokens(input_ids, positions, embed_weight, embed_scales, embed_scale, cos_table, sin_table,
                               local_cos_table, local_sin_table, kv_caches, kv_scales, kv_groups, slot_mappings,
                               block_tables, std::move(seq_lens), query_start_loc, roles_kind, std::move(prompt_rows),
                               std::move(generated_rows), std::move(output_rows));
}

torch::Tensor FusedDecoderLayers::decode_round(
    int64_t num_steps, const torch::Tensor& input_ids, const torch::Tensor& positions, int64_t block_size,
    const torch::Tensor& embed_weight, const c10::optional<torch::Tensor>& embed_scales, double embed_scale,
    const torch::Tensor& cos_table, const torch::Tensor& sin_table, const torch::Tensor& local_cos_table,
    const torch::Tensor& local_sin_table, const std::vector<torch::Tensor>& kv_caches,
    const std::vector<torch::Tensor>& kv_scales, const std::vector<int64_t>& kv_groups,
    const std::vector<torch::Tensor>& slot_mappings, const std::vector<torch::Tensor>& block_tables,
    const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, const torch::Tensor& norm_weight,
    double norm_eps, double norm_offset, const torch::Tensor& screen, const torch::Tensor& exact,
    const c10::optional<torch::Tensor>& exact_scales, int64_t top_k, const torch::Tensor& logits) const {
  return impl_->decode_round(num_steps, input_ids, positions, block_size, embed_weight, embed_scales, embed_scale,
                             cos_table, sin_table, local_cos_table, local_sin_table, kv_caches, kv_scales, kv_groups,
                             slot_mappings, block_tables, seq_lens, query_start_loc, norm_weight, norm_eps,
                             norm_offset, screen, exact, exact_scales, top_k, logits);
}

size_t FusedDecoderLayers::num_layers() const { return impl_->num_layers(); }

bool FusedDecoderLayers::team_safe() const { return impl_->team_safe(); }

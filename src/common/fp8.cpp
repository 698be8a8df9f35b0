// src/common/fp8.cpp — the public FP8 quantization ops: layouts, edge checks, output allocation
// (one packed allocation for every output the caller did not give), dispatch to the backends.
#include "gmoe/fp8.h"

#include <string>
#include <vector>

#include "common/backend.h"
#include "common/checks.h"
#include "common/fp8_checks.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

TensorView shaped(DType dtype, Device device, std::initializer_list<int64_t> shape) {
  return TensorView(nullptr, dtype, device, shape);
}

void check_options(const Fp8QuantizeOptions& o, const char* op) {
  GMOE_CHECK(is_fp8_format(o.format), op, ": options.format: expected e4m3 or e5m2, got ",
             dtype_name(o.format));
  GMOE_CHECK(o.recipe == Fp8Recipe::tensorwise || o.recipe == Fp8Recipe::blockwise ||
                 o.recipe == Fp8Recipe::mxfp8,
             op, ": options.recipe: unknown value ", static_cast<int>(o.recipe));
  GMOE_CHECK(o.rowwise || o.columnwise, op,
             ": options: neither rowwise nor columnwise output was asked for");
}

DType scale_dtype(Fp8Recipe r) { return r == Fp8Recipe::mxfp8 ? DType::e8m0 : DType::f32; }

// Resolves each wanted output: the caller's view (checked) or a slice of one packed allocation.
class OutputPlan {
 public:
  // `slot` gets either `given` (when defined) or a slice planned from `expected`.
  void add(TensorView* slot, const TensorView& expected, const TensorView& given,
           const std::string& name) {
    if (given.defined()) {
      check_layout_view(given, expected, name);
      *slot = given;
      return;
    }
    *slot = expected;
    pending_.push_back({slot, total_});
    total_ += (expected.nbytes() + 255) / 256 * 256;  // 256-byte aligned slices
  }
  std::shared_ptr<Buffer> allocate(Allocator& alloc, Stream stream) {
    if (pending_.empty()) return nullptr;
    auto buffer = std::make_shared<Buffer>(alloc, static_cast<std::size_t>(total_), stream);
    for (const Pending& p : pending_) {
      p.slot->data = total_ == 0 ? nullptr : static_cast<char*>(buffer->data()) + p.offset;
    }
    return buffer;
  }

 private:
  struct Pending {
    TensorView* slot;
    int64_t offset;
  };
  std::vector<Pending> pending_;
  int64_t total_ = 0;
};

// The copies that `o` asks for, planned into `q` from the layout `l` and the caller's `given` views
// (Fp8Grouped or Fp8Weights). Tensorwise rowwise + columnwise share the [E] scales unless the caller
// gave two arrays: scale_inv_t is then pointed at scale_inv by allocate_copies.
template <class Q>
void plan_copies(Q& q, const Q& l, const Q& given, const Fp8QuantizeOptions& o, OutputPlan& plan) {
  q.recipe = o.recipe;
  q.format = o.format;
  if (o.rowwise) {
    plan.add(&q.data, l.data, given.data, "out.data");
    plan.add(&q.scale_inv, l.scale_inv, given.scale_inv, "out.scale_inv");
  }
  if (o.columnwise) {
    plan.add(&q.data_t, l.data_t, given.data_t, "out.data_t");
    if (o.recipe == Fp8Recipe::tensorwise && o.rowwise && !given.scale_inv_t.defined()) {
      q.scale_inv_t = TensorView();
    } else {
      plan.add(&q.scale_inv_t, l.scale_inv_t, given.scale_inv_t, "out.scale_inv_t");
    }
  }
}

template <class Q>
std::shared_ptr<Buffer> allocate_copies(OutputPlan& plan, Q& q, const Fp8QuantizeOptions& o, Allocator& alloc,
                                        Stream stream) {
  std::shared_ptr<Buffer> storage = plan.allocate(alloc, stream);
  if (o.columnwise && !q.scale_inv_t.defined()) q.scale_inv_t = q.scale_inv;
  return storage;
}

}  // namespace

const char* fp8_recipe_name(Fp8Recipe recipe) {
  switch (recipe) {
    case Fp8Recipe::tensorwise: return "tensorwise";
    case Fp8Recipe::blockwise: return "blockwise";
    case Fp8Recipe::mxfp8: return "mxfp8";
  }
  return "unknown";
}

float fp8_max(DType format) {
  GMOE_CHECK(is_fp8_format(format), "fp8_max: expected e4m3 or e5m2, got ", dtype_name(format));
  return format == DType::e4m3 ? 448.0f : 57344.0f;
}

int64_t fp8_padded_capacity(int64_t capacity, int64_t experts) {
  return ceil_div(capacity, kFp8TokenPad) * kFp8TokenPad + kFp8TokenPad * experts;
}

Fp8Grouped fp8_grouped_layout(int64_t capacity, int64_t cols, int64_t experts,
                              const Fp8QuantizeOptions& o, Device device) {
  GMOE_CHECK(capacity >= 0 && cols >= 0 && experts >= 1, "fp8_grouped_layout: bad shape: capacity ",
             capacity, ", cols ", cols, ", experts ", experts);
  Fp8Grouped q;
  q.recipe = o.recipe;
  q.format = o.format;
  q.capacity = capacity;
  q.cols = cols;
  q.padded_capacity = fp8_padded_capacity(capacity, experts);
  const DType sd = scale_dtype(o.recipe);
  if (o.rowwise) {
    q.data = shaped(o.format, device, {capacity, cols});
    switch (o.recipe) {
      case Fp8Recipe::tensorwise: q.scale_inv = shaped(sd, device, {experts}); break;
      case Fp8Recipe::blockwise:
        q.scale_inv = shaped(sd, device, {ceil_div(cols, kFp8Block), capacity});  // token-major
        break;
      case Fp8Recipe::mxfp8:
        q.scale_inv = shaped(sd, device, {capacity, ceil_div(cols, kMxBlock)});
        break;
    }
  }
  if (o.columnwise) {
    q.data_t = shaped(o.format, device, {cols, q.padded_capacity});
    switch (o.recipe) {
      case Fp8Recipe::tensorwise: q.scale_inv_t = shaped(sd, device, {experts}); break;
      case Fp8Recipe::blockwise:
        q.scale_inv_t = shaped(sd, device, {q.padded_capacity / kFp8Block, cols});
        break;
      case Fp8Recipe::mxfp8:
        q.scale_inv_t = shaped(sd, device, {cols, q.padded_capacity / kMxBlock});
        break;
    }
  }
  q.padded_offsets = shaped(DType::i64, device, {experts + 1});
  return q;
}

Fp8Weights fp8_weights_layout(int64_t experts, int64_t rows, int64_t cols,
                              const Fp8QuantizeOptions& o, Device device) {
  GMOE_CHECK(experts >= 1 && rows >= 0 && cols >= 0, "fp8_weights_layout: bad shape: experts ",
             experts, ", rows ", rows, ", cols ", cols);
  Fp8Weights q;
  q.recipe = o.recipe;
  q.format = o.format;
  q.experts = experts;
  q.rows = rows;
  q.cols = cols;
  const DType sd = scale_dtype(o.recipe);
  const int64_t E = experts, N = rows, K = cols;
  if (o.rowwise) {
    q.data = shaped(o.format, device, {E, N, K});
    switch (o.recipe) {
      case Fp8Recipe::tensorwise: q.scale_inv = shaped(sd, device, {E}); break;
      case Fp8Recipe::blockwise:
        q.scale_inv = shaped(sd, device, {E, ceil_div(N, kFp8Block), ceil_div(K, kFp8Block)});
        break;
      case Fp8Recipe::mxfp8: q.scale_inv = shaped(sd, device, {E, N, ceil_div(K, kMxBlock)}); break;
    }
  }
  if (o.columnwise) {
    q.data_t = shaped(o.format, device, {E, K, N});
    switch (o.recipe) {
      case Fp8Recipe::tensorwise: q.scale_inv_t = shaped(sd, device, {E}); break;
      case Fp8Recipe::blockwise:
        q.scale_inv_t = shaped(sd, device, {E, ceil_div(K, kFp8Block), ceil_div(N, kFp8Block)});
        break;
      case Fp8Recipe::mxfp8:
        q.scale_inv_t = shaped(sd, device, {E, K, ceil_div(N, kMxBlock)});
        break;
    }
  }
  return q;
}

Fp8GroupedTensor quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& options,
                                  Stream stream, Allocator* alloc, const Fp8Grouped* out,
                                  const ExpertBias& column_sums) {
  check_options(options, "quantize_grouped");
  check_rows(x.data, "x.data");
  check_input_dtype(x.data.dtype, "x.data");
  check_counts(x.counts, "x.counts", x.data.device);
  const Device device = x.data.device;
  const int64_t E = x.num_groups();
  if (options.amax.defined()) {
    GMOE_CHECK(options.recipe == Fp8Recipe::tensorwise, "quantize_grouped: options.amax: only the tensorwise ",
               "recipe takes a precomputed amax, got ", fp8_recipe_name(options.recipe));
    check_f32_vector(options.amax, "options.amax", E, "one amax per expert", device);
  }
  if (column_sums.defined()) check_expert_bias(column_sums, "column_sums", E, x.cols(), x.data.dtype, device);
  const Fp8Grouped l = fp8_grouped_layout(x.capacity(), x.cols(), E, options, device);
  const Fp8Grouped given = out != nullptr ? *out : Fp8Grouped{};

  Fp8GroupedTensor result;
  Fp8Grouped& q = result.q;
  q.capacity = l.capacity;
  q.cols = l.cols;
  q.padded_capacity = l.padded_capacity;
  OutputPlan plan;
  plan_copies(q, l, given, options, plan);
  plan.add(&q.padded_offsets, l.padded_offsets, given.padded_offsets, "out.padded_offsets");

  if (device.is_cpu()) {
    result.storage = allocate_copies(plan, q, options, pick_allocator(alloc, device), stream);
    cpu_backend::quantize_grouped(x, options, q);
    if (column_sums.defined()) cpu_backend::grouped_bias_grad(x.data, x.counts, column_sums);
  } else {
    check_cuda_compiled("quantize_grouped");
    GMOE_CHECK(E <= 65535, "x.counts: at most 65535 experts on CUDA, got ", E);
    Allocator& a = pick_allocator(alloc, device);
    result.storage = allocate_copies(plan, q, options, a, stream);
    cuda_backend::quantize_grouped(x, options, q, stream, a, column_sums);
  }
  return result;
}

Fp8WeightsTensor quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& options,
                                  Stream stream, Allocator* alloc, const Fp8Weights* out) {
  check_options(options, "quantize_weights");
  GMOE_CHECK(!options.amax.defined(), "quantize_weights: options.amax: only quantize_grouped takes a precomputed ",
             "amax");
  check_expert_weights(w, "w");
  check_input_dtype(w.dtype(), "w");
  const Device device = w.device();
  const Fp8Weights l = fp8_weights_layout(w.num_experts(), w.rows(), w.cols(), options, device);
  const Fp8Weights given = out != nullptr ? *out : Fp8Weights{};

  Fp8WeightsTensor result;
  Fp8Weights& q = result.q;
  q.experts = l.experts;
  q.rows = l.rows;
  q.cols = l.cols;
  OutputPlan plan;
  plan_copies(q, l, given, options, plan);
  if (device.is_cpu()) {
    result.storage = allocate_copies(plan, q, options, pick_allocator(alloc, device), stream);
    cpu_backend::quantize_weights(w, options, q);
  } else {
    check_cuda_compiled("quantize_weights");
    GMOE_CHECK(w.num_experts() <= 65535, "w: at most 65535 experts on CUDA, got ", w.num_experts());
    Allocator& a = pick_allocator(alloc, device);
    result.storage = allocate_copies(plan, q, options, a, stream);
    cuda_backend::quantize_weights(w, options, q, stream, a);
  }
  return result;
}

void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which, Stream stream, Allocator* alloc) {
  check_rows(out, "out");
  check_input_dtype(out.dtype, "out");
  check_counts(counts, "counts", out.device);
  check_fp8_grouped(q, counts.size(0), which, which == Fp8Copy::rowwise ? q.data.device : q.data_t.device, "q",
                    "");
  GMOE_CHECK(out.size(0) == q.capacity && out.size(1) == q.cols, "out: expected [", q.capacity,
             ", ", q.cols, "] (q's source shape), got ", out.shape_str());
  const Device qdev = which == Fp8Copy::rowwise ? q.data.device : q.data_t.device;
  check_same_device(qdev, out.device, "q");
  if (out.device.is_cpu()) {
    cpu_backend::dequantize_grouped(q, counts, out, which);
  } else {
    check_cuda_compiled("dequantize_grouped");
    GMOE_CHECK(counts.size(0) <= 65535, "counts: at most 65535 experts on CUDA, got ",
               counts.size(0));
    cuda_backend::dequantize_grouped(q, counts, out, which, stream,
                                     pick_allocator(alloc, out.device));
  }
}

void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out, Fp8Copy which,
                        Stream stream, Allocator* alloc) {
  check_expert_weights(out, "out");
  check_input_dtype(out.dtype(), "out");
  check_fp8_weights(q, -1, which, which == Fp8Copy::rowwise ? q.data.device : q.data_t.device, "q", "");
  GMOE_CHECK(out.num_experts() == q.experts && out.rows() == q.rows && out.cols() == q.cols,
             "out: expected ", q.experts, " experts of [", q.rows, ", ", q.cols, "], got ",
             out.num_experts(), " of [", out.rows(), ", ", out.cols(), "]");
  const Device qdev = which == Fp8Copy::rowwise ? q.data.device : q.data_t.device;
  check_same_device(qdev, out.device(), "q");
  if (out.device().is_cpu()) {
    cpu_backend::dequantize_weights(q, out, which);
  } else {
    check_cuda_compiled("dequantize_weights");
    GMOE_CHECK(q.experts <= 65535, "q: at most 65535 experts on CUDA, got ", q.experts);
    cuda_backend::dequantize_weights(q, out, which, stream, pick_allocator(alloc, out.device()));
  }
}

}  // namespace gmoe

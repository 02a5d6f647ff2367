// torch.ops.tritonblas.* for processes without Python: the schemas, the input checks, the
// output shapes (meta tensors, symbolic sizes included) and a plain aten fallback (at::mm /
// addmm / bmm, the activation after them for ws_mm_act, the gate's before the product for
// ws_mm_gated (or, for a slope, the activation's backward op), on any device; at::_grouped_mm for
// ws_grouped_mm, whose rows past offs[-1] aten leaves unwritten where the Triton kernel writes zeros), so that a C++ process can load and run a model (an
// AOTInductor package, an exported program) that calls these ops. No autograd formula: a
// backward through the fallback goes through aten's, with torch's "no autograd kernel"
// warning.
//
// The schemas here must equal tritonblas_ops/schemas.py, which the Python ops are checked
// against; tests/test_csrc_stubs.py compares what this library registers with that file.
//
// Either side may come first in one process:
// - this library first: it defines the ops; importing tritonblas_ops then registers the
//   Python implementations (the Triton kernel, fake kernel, autograd, the torch.compile
//   decomposition) onto the existing ops, and they take precedence over the ones here.
// - tritonblas_ops first: an op that already has a schema is left alone here, entirely
//   (no second def, which the dispatcher refuses, and no kernel that would replace the
//   Triton one).
// Build: python -m tritonblas_ops.stubs build (torch.utils.cpp_extension).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <torch/library.h>

#include <sstream>
#include <string>

namespace {

// Keep equal to tritonblas_ops/schemas.py (a test fails otherwise).
constexpr const char* kWsMm = "tritonblas::ws_mm(Tensor a, Tensor b) -> Tensor";
constexpr const char* kWsAddmm =
    "tritonblas::ws_addmm(Tensor bias, Tensor a, Tensor b, *, float beta=1., float alpha=1.) "
    "-> Tensor";
constexpr const char* kWsBmm = "tritonblas::ws_bmm(Tensor a, Tensor b) -> Tensor";
constexpr const char* kWsMmAct =
    "tritonblas::ws_mm_act(Tensor a, Tensor b, Tensor? bias, *, str activation, float alpha=1.) "
    "-> Tensor";
constexpr const char* kWsMmGated =
    "tritonblas::ws_mm_gated(Tensor a, Tensor b, Tensor gate, *, str activation) -> Tensor";
constexpr const char* kWsGroupedMm =
    "tritonblas::ws_grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, "
    "ScalarType? out_dtype=None) -> Tensor";

// ---------------------------------------------------------------------------------------
// Input checks: the same conditions and messages as tritonblas_ops/ops.py
// ---------------------------------------------------------------------------------------

// A shape as Python prints a tuple: (4, 5), (4,), ().
std::string shape(const at::Tensor& t) {
  std::ostringstream out;
  auto sizes = t.sym_sizes();
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return "torch.float16";
    case c10::kBFloat16: return "torch.bfloat16";
    case c10::kFloat: return "torch.float32";
    case c10::kDouble: return "torch.float64";
    case c10::kInt: return "torch.int32";
    case c10::kLong: return "torch.int64";
    case c10::kBool: return "torch.bool";
    default: return c10::toString(t);
  }
}

std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided: return "torch.strided";
    case c10::kSparse: return "torch.sparse_coo";
    case c10::kSparseCsr: return "torch.sparse_csr";
    case c10::kSparseCsc: return "torch.sparse_csc";
    case c10::kSparseBsr: return "torch.sparse_bsr";
    case c10::kSparseBsc: return "torch.sparse_bsc";
    default: {
      std::ostringstream out;
      out << layout;
      return out.str();
    }
  }
}

void check_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name,
              " must be a dense (strided) tensor, got layout ", layout_name(t.layout()));
}

void check_operands(const char* op, const at::Tensor& a, const at::Tensor& b, int64_t rank) {
  check_tensor(op, "a", a);
  check_tensor(op, "b", b);
  TORCH_CHECK(a.dim() == rank, op, ": a must be a ", rank, "-D tensor, got shape ", shape(a));
  TORCH_CHECK(b.dim() == rank, op, ": b must be a ", rank, "-D tensor, got shape ", shape(b));
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": a and b must have the same dtype, got ",
              dtype_name(a.scalar_type()), " and ", dtype_name(b.scalar_type()));
  auto dtype = a.scalar_type();
  TORCH_CHECK(dtype == c10::kHalf || dtype == c10::kBFloat16 || dtype == c10::kFloat, op,
              ": dtype ", dtype_name(dtype),
              " is not supported; use float16, bfloat16 or float32");
  TORCH_CHECK(a.device() == b.device(), op, ": a and b must be on the same device, got ",
              a.device(), " and ", b.device());
  TORCH_CHECK(a.sym_size(-1) == b.sym_size(-2), op, ": inner dimensions differ: a is ", shape(a),
              ", b is ", shape(b));
  if (rank == 3) {
    TORCH_CHECK(a.sym_size(0) == b.sym_size(0), op, ": batch sizes differ: a is ", shape(a),
                ", b is ", shape(b));
  }
}

void check_bias(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                const char* op = "ws_addmm", const char* name = "bias") {
  check_tensor(op, name, bias);
  TORCH_CHECK(bias.scalar_type() == a.scalar_type(),
              op, ": ", name, " must have the dtype of a and b (", dtype_name(a.scalar_type()),
              "), got ", dtype_name(bias.scalar_type()));
  TORCH_CHECK(bias.device() == a.device(), op, ": ", name, " must be on ", a.device(), ", got ",
              bias.device());
  const c10::SymInt out[2] = {a.sym_size(0), b.sym_size(1)};
  bool broadcasts = bias.dim() <= 2;
  for (int64_t i = 0; broadcasts && i < bias.dim(); ++i) {
    const c10::SymInt& size = bias.sym_size(bias.dim() - 1 - i);
    broadcasts = size == 1 || size == out[1 - i];
  }
  TORCH_CHECK(broadcasts, op, ": ", name, " of shape ", shape(bias), " does not broadcast to (",
              out[0], ", ", out[1], ")");
}

// ---------------------------------------------------------------------------------------
// The kernels: aten's GEMMs, or only the output's shape for meta tensors
// ---------------------------------------------------------------------------------------
// Registered once, to CompositeExplicitAutograd (every backend, Meta included), not to
// Meta separately: a C++ Meta kernel would stop tritonblas_ops from registering its fake
// kernel onto these ops in the torch versions whose register_fake refuses a pre-existing
// Meta kernel. Sizes are SymInts, so the shape path also serves symbolic shapes.

at::Tensor ws_mm(const at::Tensor& a, const at::Tensor& b) {
  check_operands("ws_mm", a, b, 2);
  if (a.is_meta()) {
    return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
  }
  return at::mm(a, b);
}

at::Tensor ws_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                    double beta, double alpha) {
  check_operands("ws_addmm", a, b, 2);
  check_bias(bias, a, b);
  if (a.is_meta()) {
    return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
  }
  return at::addmm(bias, a, b, beta, alpha);
}

at::Tensor ws_bmm(const at::Tensor& a, const at::Tensor& b) {
  check_operands("ws_bmm", a, b, 3);
  if (a.is_meta()) {
    return at::empty_symint({a.sym_size(0), a.sym_size(1), b.sym_size(2)}, a.options());
  }
  return at::bmm(a, b);
}

bool is_activation(c10::string_view activation) {
  return activation == "none" || activation == "relu" || activation == "gelu" ||
         activation == "gelu_tanh" || activation == "silu";
}

// An activation's derivative, as ws_mm_gated's gate function (activations.SLOPES).
bool is_slope(c10::string_view activation) {
  return activation == "d_gelu" || activation == "d_gelu_tanh" || activation == "d_silu";
}

void check_activation(const char* op, c10::string_view activation) {
  TORCH_CHECK(is_activation(activation), op, ": activation must be one of ('none', 'relu', ",
              "'gelu', 'gelu_tanh', 'silu'), got '", activation, "'");
}

void check_gate_function(const char* op, c10::string_view activation) {
  TORCH_CHECK(is_activation(activation) || is_slope(activation), op,
              ": activation must be one of ('none', 'relu', 'gelu', 'gelu_tanh', 'silu', ",
              "'d_gelu', 'd_gelu_tanh', 'd_silu'), got '", activation, "'");
}

at::Tensor activated(const at::Tensor& x, c10::string_view activation) {
  if (activation == "relu") {
    return at::relu(x);
  }
  if (activation == "gelu" || activation == "gelu_tanh") {
    return at::gelu(x, activation == "gelu" ? "none" : "tanh");
  }
  if (activation == "silu") {
    return at::silu(x);
  }
  return x;
}

at::Tensor ws_mm_act(const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias, c10::string_view activation,
                     double alpha) {
  check_operands("ws_mm_act", a, b, 2);
  if (bias.has_value()) {
    check_bias(*bias, a, b, "ws_mm_act");
  }
  check_activation("ws_mm_act", activation);
  if (a.is_meta()) {
    return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
  }
  const at::Tensor product = bias.has_value() ? at::addmm(*bias, a, b, 1, alpha)
                             : alpha == 1    ? at::mm(a, b)
                                             : at::mul(at::mm(a, b), alpha);
  return activated(product, activation);
}

at::Tensor ws_mm_gated(const at::Tensor& a, const at::Tensor& b, const at::Tensor& gate,
                       c10::string_view activation) {
  check_operands("ws_mm_gated", a, b, 2);
  check_bias(gate, a, b, "ws_mm_gated", "gate");
  check_gate_function("ws_mm_gated", activation);
  if (a.is_meta()) {
    return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
  }
  const at::Tensor product = at::mm(a, b);
  if (is_slope(activation)) {  // the product is the incoming gradient
    const at::Tensor x = gate.expand(product.sizes());
    return activation == "d_silu" ? at::silu_backward(product, x)
                                  : at::gelu_backward(product, x, activation == "d_gelu" ? "none" : "tanh");
  }
  return at::mul(activated(gate, activation), product);
}

at::Tensor ws_grouped_mm(const at::Tensor& a, const at::Tensor& b,
                         const std::optional<at::Tensor>& offs,
                         const std::optional<at::Tensor>& bias,
                         std::optional<c10::ScalarType> out_dtype) {
  const char* op = "ws_grouped_mm";
  check_tensor(op, "mat_a", a);
  check_tensor(op, "mat_b", b);
  TORCH_CHECK(a.dim() == 2 || a.dim() == 3, op, ": mat_a must be 2-D or 3-D, got shape ", shape(a));
  TORCH_CHECK(b.dim() == 2 || b.dim() == 3, op, ": mat_b must be 2-D or 3-D, got shape ", shape(b));
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op,
              ": mat_a and mat_b must have the same dtype, got ", dtype_name(a.scalar_type()),
              " and ", dtype_name(b.scalar_type()));
  TORCH_CHECK(a.sym_size(-1) == b.sym_size(-2), op, ": inner dimensions differ: mat_a is ",
              shape(a), ", mat_b is ", shape(b));
  const bool batched = a.dim() == 3 && b.dim() == 3;
  TORCH_CHECK(batched != offs.has_value(), op, batched
              ? ": offs must be None for 3-D x 3-D operands (a batched GEMM)"
              : ": offs (the groups' cumulative ends) is needed for 2-D operands");
  TORCH_CHECK(!bias.has_value(), op, ": bias is not supported (as for torch._grouped_mm)");
  TORCH_CHECK(!out_dtype.has_value() || *out_dtype == a.scalar_type(), op,
              ": out_dtype must be None or the inputs' dtype (", dtype_name(a.scalar_type()), ")");
  if (a.is_meta()) {
    if (batched) {
      return at::empty_symint({a.sym_size(0), a.sym_size(1), b.sym_size(2)}, a.options());
    }
    if (a.dim() == 2 && b.dim() == 3) {
      return at::empty_symint({a.sym_size(0), b.sym_size(2)}, a.options());
    }
    if (a.dim() == 3) {
      return at::empty_symint({a.sym_size(1), b.sym_size(1)}, a.options());
    }
    return at::empty_symint({offs->sym_size(0), a.sym_size(0), b.sym_size(1)}, a.options());
  }
  return at::_grouped_mm(a, b, offs, bias, out_dtype);
}

// ---------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------

// True when the op has no schema yet; warns when it has one that differs from `schema`.
bool undefined(const char* schema) {
  const c10::FunctionSchema ours = torch::schema(schema);
  auto existing = c10::Dispatcher::singleton().findSchema(ours.operator_name());
  if (!existing.has_value()) {
    return true;
  }
  // A warning, not an error: throwing while the library loads would abort the process.
  if (!(existing->schema() == ours)) {
    TORCH_WARN("tritonblas stubs: ", ours.name(), " is already defined as '",
               existing->schema(), "', not as '", schema, "'; its stub is not registered.");
  }
  return false;
}

template <typename Kernel>
void define(torch::Library& m, const char* schema, Kernel kernel) {
  if (!undefined(schema)) {
    return;  // tritonblas_ops (Python) or another copy of this library defined it
  }
  m.def(schema, {at::Tag::pt2_compliant_tag});
  const std::string name = torch::schema(schema).name();  // "tritonblas::ws_mm"
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, kernel));
}

}  // namespace

// A fragment: the namespace may already hold ops that tritonblas_ops defined in Python.
TORCH_LIBRARY_FRAGMENT(tritonblas, m) {
  define(m, kWsMm, TORCH_FN(ws_mm));
  define(m, kWsAddmm, TORCH_FN(ws_addmm));
  define(m, kWsBmm, TORCH_FN(ws_bmm));
  define(m, kWsMmAct, TORCH_FN(ws_mm_act));
  define(m, kWsMmGated, TORCH_FN(ws_mm_gated));
  define(m, kWsGroupedMm, TORCH_FN(ws_grouped_mm));
}

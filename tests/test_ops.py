"""torch.ops.tritonblas.*: opcheck, autograd, aten semantics, and clear errors on bad input.
CPU tensors run the real kernel through Triton's interpreter."""

import sys

import pytest
import torch
from torch.library import opcheck

import tritonblas_ops  # noqa: F401
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref

pytestmark = pytest.mark.usefixtures("poison_empty")

ops = torch.ops.tritonblas
FP32 = REL_TOLERANCE[torch.float32]


def transposed(t):
    """Same values, column-major storage (a transposed view of a contiguous tensor)."""
    return t.mT.contiguous().mT


def op_cases():
    a, b, bias = torch.randn(19, 23), torch.randn(23, 29), torch.randn(29)
    a3, b3 = torch.randn(3, 19, 23), torch.randn(3, 23, 29)
    yield "ws_mm", (a, b), {}
    yield "ws_mm", (transposed(a), transposed(b)), {}
    yield "ws_addmm", (bias, a, b), {"beta": 0.5, "alpha": 2.0}
    yield "ws_addmm", (torch.randn(19, 1), transposed(a), b), {}
    yield "ws_bmm", (a3, b3), {}
    yield "ws_bmm", (transposed(a3), transposed(b3)), {}


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", list(op_cases()), ids=lambda case: case[0])
def test_opcheck(case, requires_grad):
    name, args, kwargs = case
    args = tuple(t.detach().requires_grad_(requires_grad) for t in args)
    opcheck(getattr(ops, name), args, kwargs)  # raises on any failed check


@pytest.mark.parametrize("case", list(op_cases()), ids=lambda case: case[0])
def test_forward_and_gradients_match_aten(case):
    name, args, kwargs = case
    aten = {"ws_mm": torch.mm, "ws_addmm": torch.addmm, "ws_bmm": torch.bmm}[name]
    ours_in = [t.detach().requires_grad_() for t in args]
    ref_in = [t.detach().double().requires_grad_() for t in args]
    out = getattr(ops, name)(*ours_in, **kwargs)
    ref = aten(*ref_in, **kwargs)
    assert_matches(out, ref, FP32)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for ours, theirs in zip(ours_in, ref_in):
        assert_matches(ours.grad, theirs.grad, FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_follows_the_inputs(dtype):
    a, b = torch.randn(9, 10, dtype=dtype), torch.randn(10, 11, dtype=dtype)
    out = ops.ws_mm(a, b)
    assert out.dtype == dtype and out.shape == (9, 11)
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[dtype])


def test_addmm_beta_zero_ignores_nan_bias_like_torch():
    a, b = torch.randn(6, 7), torch.randn(7, 8)
    bias = torch.full((8,), float("nan"))
    out = ops.ws_addmm(bias, a, b, beta=0.0, alpha=1.5)
    assert_matches(out, matmul_ref(a, b, alpha=1.5), FP32)


@pytest.mark.parametrize(
    "shape_a,shape_b",
    [((0, 5), (5, 7)), ((4, 5), (5, 0)), ((0, 0), (0, 0))],
)
def test_empty_outputs(shape_a, shape_b):
    out = ops.ws_mm(torch.randn(shape_a), torch.randn(shape_b))
    assert out.shape == (shape_a[0], shape_b[1])


def test_zero_k_gives_zeros_and_beta_bias():
    a, b = torch.randn(4, 0), torch.randn(0, 6)
    assert torch.equal(ops.ws_mm(a, b), torch.zeros(4, 6))
    bias = torch.randn(6)
    assert torch.equal(ops.ws_addmm(bias, a, b, beta=2.0), torch.addmm(bias, a, b, beta=2.0))
    assert ops.ws_bmm(torch.randn(0, 4, 5), torch.randn(0, 5, 6)).shape == (0, 4, 6)
    assert torch.equal(ops.ws_bmm(torch.randn(2, 4, 0), torch.randn(2, 0, 6)), torch.zeros(2, 4, 6))


M = torch.randn(4, 5)
BAD_INPUTS = [
    ("ws_mm", (torch.randn(4), torch.randn(4, 5)), RuntimeError, r"ws_mm: a must be a 2-D tensor, got shape \(4,\)"),
    ("ws_mm", (M, torch.randn(2, 5, 3)), RuntimeError, r"ws_mm: b must be a 2-D tensor, got shape \(2, 5, 3\)"),
    ("ws_mm", (M, torch.randn(6, 3)), RuntimeError, r"ws_mm: inner dimensions differ: a is \(4, 5\), b is \(6, 3\)"),
    ("ws_mm", (M, torch.randn(5, 3, dtype=torch.float16)), RuntimeError,
     r"ws_mm: a and b must have the same dtype, got torch.float32 and torch.float16"),
    ("ws_mm", (M.double(), torch.randn(5, 3, dtype=torch.float64)), RuntimeError,
     r"ws_mm: dtype torch.float64 is not supported; use float16, bfloat16 or float32"),
    ("ws_mm", (M.int(), torch.ones(5, 3, dtype=torch.int32)), RuntimeError,
     r"ws_mm: dtype torch.int32 is not supported"),
    ("ws_mm", (M, torch.randn(5, 3, device="meta")), RuntimeError,
     r"ws_mm: a and b must be on the same device, got cpu and meta"),
    ("ws_mm", (M, 3.0), RuntimeError,
     r"tritonblas::ws_mm\(\) Expected a value of type 'Tensor' for argument 'b' but instead found type 'float'"),
    ("ws_bmm", (torch.randn(2, 4, 5), torch.randn(3, 5, 6)), RuntimeError,
     r"ws_bmm: batch sizes differ: a is \(2, 4, 5\), b is \(3, 5, 6\)"),
    ("ws_bmm", (M, torch.randn(5, 6)), RuntimeError, r"ws_bmm: a must be a 3-D tensor"),
    ("ws_addmm", (torch.randn(4, 7), M, torch.randn(5, 6)), RuntimeError,
     r"ws_addmm: bias of shape \(4, 7\) does not broadcast to \(4, 6\)"),
    ("ws_addmm", (torch.randn(2, 4, 6), M, torch.randn(5, 6)), RuntimeError,
     r"ws_addmm: bias of shape \(2, 4, 6\) does not broadcast to \(4, 6\)"),
    ("ws_addmm", (torch.randn(6, dtype=torch.float16), M, torch.randn(5, 6)), RuntimeError,
     r"ws_addmm: bias must have the dtype of a and b \(torch.float32\), got torch.float16"),
]


@pytest.mark.parametrize("name,args,error,message", BAD_INPUTS, ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_clearly(name, args, error, message):
    with pytest.raises(error, match=message):
        getattr(ops, name)(*args)
    # Nothing was left half-done: the next good call is right.
    a, b = torch.randn(8, 9), torch.randn(9, 10)
    assert_matches(ops.ws_mm(a, b), matmul_ref(a, b), FP32)


def test_bad_input_is_refused_while_tracing_too():
    with pytest.raises(RuntimeError, match="ws_mm: inner dimensions differ"):
        torch.compile(ops.ws_mm, backend="aot_eager", fullgraph=True)(M, torch.randn(6, 3))


@pytest.mark.parametrize("name", ["ws_mm", "ws_addmm", "ws_bmm"])
def test_real_tensors_reach_the_body_without_custom_ops_wrappers(name, monkeypatch):
    """The body is registered straight to the CPU and CUDA keys (beside custom_op's own
    registration, which fake, autograd and tracing still use); an eager call runs it
    without custom_op's backend wrapper in between."""
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tritonblas::{name}", key)
    from torch._library import custom_ops

    def wrapper_called(*args, **kwargs):
        raise AssertionError("custom_op's backend wrapper ran")

    op = custom_ops._maybe_get_opdef(f"tritonblas::{name}")
    monkeypatch.setattr(op, "_backend_fns", {None: wrapper_called})
    a, b = torch.randn(2, 5, 4), torch.randn(2, 4, 3)
    args = {"ws_mm": (a[0], b[0]), "ws_addmm": (torch.randn(3), a[0], b[0]), "ws_bmm": (a, b)}[name]
    expected = {"ws_mm": torch.mm, "ws_addmm": torch.addmm, "ws_bmm": torch.bmm}[name](*args)
    assert_matches(getattr(torch.ops.tritonblas, name)(*args), expected.double(), REL_TOLERANCE[torch.float32])


def _python_calls_of(fn) -> list[str]:
    """Names of the Python functions that `fn()` calls, in order."""
    calls = []

    def record(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_calls_without_grads_skip_custom_ops_autograd_layer():
    """With no input requiring grad, the dispatcher's autograd kernel runs the body itself
    (custom_op's would enter the dispatcher a second time: an OpOverload.redispatch); with
    one, custom_op's autograd runs and the output gets its grad_fn."""
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    calls = _python_calls_of(lambda: ops.ws_mm(a, b))
    assert "ws_mm" in calls and "redispatch" not in calls, calls
    with torch.no_grad():
        calls = _python_calls_of(lambda: ops.ws_mm(a.requires_grad_(), b))
    assert "ws_mm" in calls and "redispatch" not in calls, calls
    out = None

    def with_grad():
        nonlocal out
        out = ops.ws_mm(a, b)

    assert "redispatch" in _python_calls_of(with_grad)
    assert out.grad_fn is not None
    out.sum().backward()
    assert_matches(a.grad, torch.ones(8, 6).double() @ b.double().T, FP32)


def test_dispatch_modes_still_see_the_ops():
    """A TorchDispatchMode (a profiler, a FLOP counter) is below autograd: the autograd
    kernel's shortcut must not run the body past it, also after a plain call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    bias, a, b = torch.randn(6), torch.randn(8, 4), torch.randn(4, 6)
    ops.ws_addmm(bias, a, b, beta=0.5)  # the shortcut's answer for plain calls is kept
    with Log():
        out = ops.ws_addmm(bias, a, b, beta=0.5)
    assert seen == [ops.ws_addmm.default]
    assert out.shape == (8, 6)

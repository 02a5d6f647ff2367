"""torch.ops.tritonblas.*: opcheck, autograd, aten semantics, and clear errors on bad input.
CPU tensors run the real kernel through Triton's interpreter."""

import functools

import pytest
import torch
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import tritonblas_ops  # noqa: F401
from tritonblas_ops import activations
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref
from tiles import m_dependent_tiles  # noqa: F401  (a fixture)

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
    yield "ws_mm_act", (a, b, bias), {"activation": "gelu_tanh"}
    yield "ws_mm_act", (transposed(a), b, None), {"activation": "silu"}
    yield "ws_mm_act", (a, transposed(b), torch.randn(19, 1)), {"activation": "gelu"}
    yield "ws_mm_act", (a, b, bias), {"activation": "relu"}
    yield "ws_mm_act", (a, b, torch.randn(19, 29)), {"activation": "none"}  # a residual fused
    yield "ws_mm_act", (a, b, torch.randn(19, 29)), {"activation": "none", "alpha": 0.5}  # LoRA's update
    yield "ws_mm_act", (transposed(a), b, None), {"activation": "none", "alpha": -3.0}  # a scale
    yield "ws_mm_act", (a, b, bias), {"activation": "gelu", "alpha": 0.25}
    yield "ws_mm_gated", (a, b, torch.randn(19, 29)), {"activation": "silu"}
    yield "ws_mm_gated", (transposed(a), b, torch.randn(19, 29)), {"activation": "gelu_tanh"}
    yield "ws_mm_gated", (a, transposed(b), bias), {"activation": "gelu"}
    # Activations' backward fed by a GEMM: the gate is the forward's input.
    yield "ws_mm_gated", (a, b, torch.randn(19, 29)), {"activation": "d_gelu_tanh"}
    yield "ws_mm_gated", (transposed(a), b, torch.randn(19, 29)), {"activation": "d_silu"}
    yield "ws_mm_gated", (a, transposed(b), torch.randn(19, 29)), {"activation": "d_gelu"}


def mm_act(a, b, bias, *, activation, alpha=1.0):
    """ws_mm_act's meaning in aten ops."""
    product = torch.mm(a, b) * alpha if bias is None else torch.addmm(bias, a, b, alpha=alpha)
    return activations.apply(product, activation)


def mm_gated(a, b, gate, *, activation):
    """ws_mm_gated's meaning in aten ops: with a slope, torch's backward of the activation
    at the gate, the product its incoming gradient."""
    product = torch.mm(a, b)
    if activation in activations.SLOPES:
        forward = functools.partial(activations.apply, activation=activation.removeprefix("d_"))
        return torch.func.vjp(forward, gate)[1](product)[0]
    return activations.apply(gate, activation) * product


ATEN = {"ws_mm": torch.mm, "ws_addmm": torch.addmm, "ws_bmm": torch.bmm, "ws_mm_act": mm_act,
        "ws_mm_gated": mm_gated}


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", list(op_cases()), ids=lambda case: case[0])
def test_opcheck(case, requires_grad):
    name, args, kwargs = case
    args = tuple(t if t is None else t.detach().requires_grad_(requires_grad) for t in args)
    opcheck(getattr(ops, name), args, kwargs)  # raises on any failed check


@pytest.mark.parametrize("case", list(op_cases()), ids=lambda case: case[0])
def test_forward_and_gradients_match_aten(case):
    name, args, kwargs = case
    aten = ATEN[name]
    ours_in = [t if t is None else t.detach().requires_grad_() for t in args]
    ref_in = [t if t is None else t.detach().double().requires_grad_() for t in args]
    out = getattr(ops, name)(*ours_in, **kwargs)
    ref = aten(*ref_in, **kwargs)
    assert_matches(out, ref, FP32)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for ours, theirs in zip(ours_in, ref_in):
        if ours is not None:
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
    assert torch.equal(ops.ws_mm_gated(a, b, torch.randn(4, 6), activation="silu"), torch.zeros(4, 6))
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


def test_mm_gated_refuses_an_unknown_activation_and_a_bad_gate():
    with pytest.raises(RuntimeError, match=r"ws_mm_gated: activation must be one of .*got 'tanh'"):
        ops.ws_mm_gated(M, torch.randn(5, 3), torch.randn(4, 3), activation="tanh")
    with pytest.raises(RuntimeError, match=r"ws_mm_gated: gate of shape \(4, 7\) does not broadcast to \(4, 3\)"):
        ops.ws_mm_gated(M, torch.randn(5, 3), torch.randn(4, 7), activation="silu")


def test_mm_act_refuses_an_unknown_activation_and_a_bad_bias():
    with pytest.raises(RuntimeError, match=r"ws_mm_act: activation must be one of .*got 'tanh'"):
        ops.ws_mm_act(M, torch.randn(5, 3), None, activation="tanh")
    with pytest.raises(RuntimeError, match=r"ws_mm_act: bias of shape \(4, 7\) does not broadcast to \(4, 3\)"):
        ops.ws_mm_act(M, torch.randn(5, 3), torch.randn(4, 7), activation="relu")


def test_bad_input_is_refused_while_tracing_too():
    with pytest.raises(RuntimeError, match="ws_mm: inner dimensions differ"):
        torch.compile(ops.ws_mm, backend="aot_eager", fullgraph=True)(M, torch.randn(6, 3))


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


# ---------------------------------------------------------------------------------------
# Forward-mode AD: the GEMM is bilinear, d(a @ b) = da @ b + a @ db
# ---------------------------------------------------------------------------------------


def jvp_cases():
    a, b, bias = torch.randn(19, 23), torch.randn(23, 29), torch.randn(29)
    a3, b3 = torch.randn(3, 19, 23), torch.randn(3, 23, 29)
    yield "ws_mm", torch.mm, (a, b), {}
    yield "ws_addmm", torch.addmm, (bias, a, b), {"beta": 0.5, "alpha": 2.0}
    yield "ws_addmm", torch.addmm, (torch.randn(19, 1), transposed(a), b), {}
    yield "ws_bmm", torch.bmm, (a3, b3), {}
    yield "ws_mm_act", mm_act, (a, b, bias), {"activation": "gelu_tanh"}
    yield "ws_mm_act", mm_act, (a, b), {"bias": None, "activation": "silu"}
    yield "ws_mm_act", mm_act, (a, b, bias), {"activation": "silu", "alpha": -0.5}
    yield "ws_mm_act", mm_act, (a, b, torch.randn(19, 29)), {"activation": "none", "alpha": 2.0}
    yield "ws_mm_gated", mm_gated, (a, b, torch.randn(19, 29)), {"activation": "silu"}
    yield "ws_mm_gated", mm_gated, (a, b, bias), {"activation": "gelu"}
    yield "ws_mm_gated", mm_gated, (a, b, torch.randn(19, 29)), {"activation": "d_gelu"}
    yield "ws_mm_gated", mm_gated, (a, b, torch.randn(19, 29)), {"activation": "d_silu"}


@pytest.mark.parametrize("case", list(jvp_cases()), ids=lambda case: case[0])
def test_forward_mode_tangents_match_aten(case):
    """torch.func.jvp and forward_ad's dual tensors, with tangents on every input and on
    one of them: the op's tangent is aten's, computed by the kernel."""
    name, aten, args, kwargs = case
    op = getattr(ops, name)
    for tangent_on in [range(len(args)), [len(args) - 1]]:
        tangents = tuple(torch.randn_like(t) if i in tangent_on else torch.zeros_like(t)
                         for i, t in enumerate(args))
        want_out, want = torch.func.jvp(lambda *xs: aten(*xs, **kwargs), args, tangents)
        out, got = torch.func.jvp(lambda *xs: op(*xs, **kwargs), args, tangents)
        assert_matches(out, want_out.double(), FP32)
        assert_matches(got, want.double(), FP32)
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        duals = [fwad.make_dual(t, torch.randn_like(t)) for t in args]
        got = fwad.unpack_dual(op(*duals, **kwargs)).tangent
        want = fwad.unpack_dual(aten(*duals, **kwargs)).tangent
    assert got is not None, "forward_ad got no tangent"
    assert_matches(got, want.double(), FP32)


def test_torch_func_transforms():
    """Jacobians both ways, grad and vmap over the ops, as over aten's."""
    a, b, bias = torch.randn(5, 4), torch.randn(4, 3), torch.randn(3)
    for transform in (torch.func.jacfwd, torch.func.jacrev):
        got = transform(lambda x, y: ops.ws_addmm(bias, x, y, alpha=0.5), argnums=(0, 1))(a, b)
        want = transform(lambda x, y: torch.addmm(bias, x, y, alpha=0.5), argnums=(0, 1))(a, b)
        for g, w in zip(got, want):
            assert_matches(g, w.double(), FP32)
    got = torch.func.grad(lambda x: ops.ws_mm(x, b).square().sum())(a)
    assert_matches(got, torch.func.grad(lambda x: torch.mm(x, b).square().sum())(a).double(), FP32)
    a3 = torch.randn(2, 5, 4)
    assert_matches(torch.func.vmap(ops.ws_mm, in_dims=(0, None))(a3, b), (a3 @ b).double(), FP32)


VMAP_CASES = [  # (op, aten, operand shapes, in_dims, the op's calls): the vmap dimension in varied places
    ("ws_mm", torch.mm, [(3, 5, 4), (4, 6)], (0, None), 1),
    ("ws_mm", torch.mm, [(5, 4), (4, 3, 6)], (None, 1), 1),
    ("ws_mm", torch.mm, [(5, 3, 4), (3, 4, 6)], (1, 0), 1),
    ("ws_bmm", torch.bmm, [(3, 2, 5, 4), (2, 4, 6)], (0, None), 1),
    ("ws_bmm", torch.bmm, [(2, 5, 4), (2, 4, 6, 3)], (None, 3), 1),
    ("ws_bmm", torch.bmm, [(3, 2, 5, 4), (3, 2, 4, 6)], (0, 0), 1),
    ("ws_addmm", torch.addmm, [(6,), (3, 5, 4), (4, 6)], (None, 0, None), 1),
    ("ws_addmm", torch.addmm, [(5, 6), (5, 3, 4), (4, 6)], (None, 1, None), 1),
    ("ws_addmm", torch.addmm, [(5, 1), (3, 5, 4), (4, 6)], (None, 0, None), 1),
    ("ws_addmm", torch.addmm, [(3, 6), (5, 4), (4, 6)], (0, None, None), 1),
    ("ws_addmm", torch.addmm, [(5, 3, 1), (3, 5, 4), (4, 6)], (1, 0, None), 1),
    ("ws_addmm", torch.addmm, [(3,), (3, 5, 4), (4, 6)], (0, 0, None), 1),
    ("ws_addmm", torch.addmm, [(6,), (3, 5, 4), (3, 4, 6)], (None, 0, 0), 3),  # no batched addmm
]


class _OpCalls(TorchDispatchMode):
    """The tritonblas ops the dispatcher runs, after torch.func's transforms."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tritonblas":
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name, aten, shapes, in_dims, calls", VMAP_CASES)
def test_vmap_runs_the_batch_in_one_call(name, aten, shapes, in_dims, calls):
    """vmap over an op matches vmap over aten's, in one call of the op where a batched op can
    take the batch (functorch's fallback would call it once per example)."""
    operands = [torch.randn(shape) for shape in shapes]
    kwargs = {"beta": 0.5, "alpha": 2.0} if name == "ws_addmm" else {}
    with _OpCalls() as seen:
        got = torch.func.vmap(functools.partial(getattr(ops, name), **kwargs), in_dims=in_dims)(*operands)
    want = torch.func.vmap(functools.partial(aten, **kwargs), in_dims=in_dims)(*(t.double() for t in operands))
    assert_matches(got, want, FP32)
    assert len(seen.calls) == calls, seen.calls


@pytest.mark.parametrize("name, shapes, in_dims, message", [
    ("ws_mm", [(3, 4), (4, 6)], (0, None), "2-D"),  # each example's a is a vector
    ("ws_mm", [(3, 5, 4), (5, 6)], (0, None), "inner dimensions"),
    ("ws_bmm", [(3, 5, 4), (3, 4, 6)], (0, 0), "3-D"),
    ("ws_addmm", [(3, 7), (3, 5, 4), (4, 6)], (0, 0, None), "bias"),
])
def test_vmap_checks_each_example_as_the_op_does(name, shapes, in_dims, message):
    """The batching rules fold examples together: each example is checked first, so an
    example of the wrong rank or size raises the op's own error."""
    operands = [torch.randn(shape) for shape in shapes]
    with pytest.raises(RuntimeError, match=message):
        torch.func.vmap(getattr(ops, name), in_dims=in_dims)(*operands)


def test_gradients_through_vmap():
    """Per-example gradients (vmap of grad) and the gradient of a vmapped op, as aten's."""
    a, b = torch.randn(3, 5, 4), torch.randn(4, 6)
    per_example = torch.func.vmap(torch.func.grad(lambda x, y: ops.ws_mm(x, y).square().sum(), argnums=1),
                                  in_dims=(0, None))(a, b)
    want = torch.func.vmap(torch.func.grad(lambda x, y: torch.mm(x, y).square().sum(), argnums=1),
                           in_dims=(0, None))(a.double(), b.double())
    assert_matches(per_example, want, FP32)
    got = torch.func.grad(lambda y: torch.func.vmap(ops.ws_mm, in_dims=(0, None))(a, y).square().sum())(b)
    assert_matches(got, torch.func.grad(lambda y: (a.double() @ y).square().sum())(b.double()), FP32)


def test_nan_and_inf_inputs_raise_no_warnings_from_the_interpreter():
    """inf - inf and 0 * inf are IEEE results on the GPU too: numpy's warnings about them,
    inside Triton's interpreter, must not reach the user."""
    import warnings

    a, b = torch.randn(9, 7), torch.randn(7, 5)
    a[0, 0], a[1, 1], b[2, 2] = float("nan"), float("inf"), 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = ops.ws_addmm(torch.full((5,), float("-inf")), a, b)
    assert torch.isnan(out).any() and torch.isinf(out).any()


# ---------------------------------------------------------------------------------------
# Batch-invariant mode
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ws_mm", "ws_addmm", "ws_bmm"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(name, m_dependent_tiles):
    """ws_mm(a[:m], b)[i] == ws_mm(a, b)[i] bitwise for every m with batch_invariant(True);
    without it, the M-dependent tiles and K splits change some rows' bits."""
    a, b, bias = torch.randn(40, 96), torch.randn(96, 24), torch.randn(24)
    if name == "ws_bmm":
        a, b = torch.randn(2, 40, 96), torch.randn(2, 96, 24)

    def call(rows):
        if name == "ws_addmm":
            return ops.ws_addmm(bias, a[:rows], b, beta=0.5, alpha=2.0)
        return getattr(ops, name)(a[..., :rows, :], b)

    def reference(rows):
        if name == "ws_addmm":
            return matmul_ref(a[:rows], b, bias, alpha=2.0, beta=0.5)
        return matmul_ref(a[..., :rows, :], b)

    def rows_match(rows) -> bool:
        full, part = call(40), call(rows)
        return torch.equal(part, full[..., :rows, :])

    sizes = (1, 3, 5, 17, 24, 31)
    tritonblas_ops.batch_invariant(False)
    assert not all(rows_match(rows) for rows in sizes)
    tritonblas_ops.batch_invariant(True)
    for rows in sizes:
        assert rows_match(rows), rows
        assert_matches(call(rows), reference(rows), FP32)

"""torch.ops.tritonblas.ws_mm / ws_addmm / ws_bmm: checks, kernels, fake kernels, autograd.

Each op is a `triton_op`, so torch.compile sees the Triton kernel itself rather than an
opaque call. CPU tensors run the same kernel through Triton's interpreter (for tests and
demos, not speed); while CPU inputs are being traced, the body returns the aten result.

The schemas are also declared in C++ (csrc_stubs/, for processes without Python): they must
equal schemas.SCHEMAS, and when the C++ stubs were loaded first the ops below adopt the
C++ definitions instead of defining the ops again (schemas.py).
"""

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from tritonblas_ops.kernel import ws_matmul
from tritonblas_ops.schemas import NAMESPACE, SCHEMAS, adopt_cpp_definitions, defined_schema

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------
# Input checks, shared by the real and fake kernels (torch._check works on SymInts too)
# ---------------------------------------------------------------------------------------


def _check(cond, message) -> None:
    """torch._check, with a shortcut for a plain True: real tensors give Python bools, and
    the ten checks of a call cost ~17 us of host time through torch._check alone."""
    if cond is not True:
        torch._check(cond, message)  # raises RuntimeError(message()); handles SymBool


def _check_tensor(op: str, name: str, t) -> None:
    torch._check_type(
        isinstance(t, Tensor), lambda: f"{op}: {name} must be a Tensor, got {type(t).__name__}"
    )
    _check(
        t.layout == torch.strided,
        lambda: f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}",
    )


def _operands_plainly_valid(a, b, rank: int) -> bool:
    """Every check of _check_operands at once, for real tensors: one expression instead of
    ten torch._check calls on the eager hot path. False sends the caller to the checks."""
    return (
        type(a) in _PLAIN_TENSORS and type(b) in _PLAIN_TENSORS
        and a.layout == torch.strided and b.layout == torch.strided
        and a.dim() == rank and b.dim() == rank
        and a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES and a.device == b.device
        and a.shape[-1] == b.shape[-2] and (rank == 2 or a.shape[0] == b.shape[0])
    )


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)  # sizes are ints: no SymInt guards


def _check_operands(op: str, a: Tensor, b: Tensor, rank: int) -> None:
    if _operands_plainly_valid(a, b, rank):
        return
    for name, t in (("a", a), ("b", b)):
        _check_tensor(op, name, t)
    for name, t in (("a", a), ("b", b)):
        _check(
            t.dim() == rank,
            lambda: f"{op}: {name} must be a {rank}-D tensor, got shape {tuple(t.shape)}",
        )
    _check(
        a.dtype == b.dtype,
        lambda: f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}",
    )
    _check(
        a.dtype in SUPPORTED_DTYPES,
        lambda: f"{op}: dtype {a.dtype} is not supported; use float16, bfloat16 or float32",
    )
    _check(
        a.device == b.device,
        lambda: f"{op}: a and b must be on the same device, got {a.device} and {b.device}",
    )
    _check(
        a.shape[-1] == b.shape[-2],
        lambda: f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}",
    )
    if rank == 3:
        _check(
            a.shape[0] == b.shape[0],
            lambda: f"{op}: batch sizes differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}",
        )


def _check_bias(bias: Tensor, a: Tensor, b: Tensor) -> None:
    _check_tensor("ws_addmm", "bias", bias)
    out_shape = (a.shape[0], b.shape[1])
    _check(
        bias.dtype == a.dtype,
        lambda: f"ws_addmm: bias must have the dtype of a and b ({a.dtype}), got {bias.dtype}",
    )
    _check(
        bias.device == a.device,
        lambda: f"ws_addmm: bias must be on {a.device}, got {bias.device}",
    )
    broadcasts = bias.dim() <= 2 and all(
        size == 1 or size == out
        for size, out in zip(reversed(bias.shape), reversed(out_shape))
    )
    _check(
        broadcasts,
        lambda: f"ws_addmm: bias of shape {tuple(bias.shape)} does not broadcast to {out_shape}",
    )


# ---------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------


# Real CPU and CUDA tensors reach the op's body straight from the dispatcher: custom_op's
# own backend registration (CompositeExplicitAutograd) wraps it in an aliasing check, a
# dynamo guard and triton_op's wrapper, ~6 of an op call's ~15 us of host time on a CPU
# (benchmarks/NOTES.md, step 8). Outputs are always fresh tensors, so no check is lost.
# Everything else stays triton_op's: fake kernels, autograd, torch.compile's decomposition.
_DIRECT_KERNELS = torch.library.Library(NAMESPACE, "IMPL")


# ---------------------------------------------------------------------------------------
# A call that needs no gradient skips custom_op's autograd layer, a Python kernel that
# enters the dispatcher again to reach the body: ~8 of an op call's ~15 us of host time on
# a CPU of the CI's kind. Kernels on the AutogradCPU and AutogradCUDA keys take precedence
# over custom_op's on the Autograd alias key; they call the body directly when no input
# requires grad and the keys below autograd would lead straight to it (no dispatch mode,
# subclass, functionalization or other wrapper), and hand every other call to custom_op's
# own autograd kernel.
# ---------------------------------------------------------------------------------------

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BODY_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
# keyset.raw_repr() -> whether the keys below autograd lead straight to the body. Computing
# it takes three pybind calls (~3 us on the H200's host); a call's keyset is one of a few.
_straight_to_body: dict[int, bool] = {}


def _leads_straight_to_body(keyset) -> bool:
    raw = keyset.raw_repr()
    straight = _straight_to_body.get(raw)
    if straight is None:
        straight = _straight_to_body[raw] = (
            (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _BODY_KEYS)
    return straight


def _needs_grad(args) -> bool:
    if torch.is_grad_enabled():
        for t in args:
            if isinstance(t, Tensor) and t.requires_grad:
                return True
    return False


def _skip_autograd_without_grads(op, body) -> None:
    """custom_op's autograd kernel reads the op's backward and setup_context when called,
    so this may run before register_autograd."""
    custom_autograd = torch._library.autograd.make_autograd_impl(op._opoverload, op)

    def autograd_kernel(keyset, *args, **keyword_only_args):
        if _leads_straight_to_body(keyset) and not _needs_grad(args):
            return body(*args, **keyword_only_args)
        return custom_autograd(keyset, *args, **keyword_only_args)

    for dispatch_key in ("AutogradCPU", "AutogradCUDA"):
        _DIRECT_KERNELS.impl(op._name, autograd_kernel, dispatch_key, with_keyset=True)


def _triton_op(name: str):
    """`triton_op(f"tritonblas::{name}", mutates_args=())`, adopting the op if the C++ stubs
    already defined it; the schema torch infers from the annotations must be SCHEMAS[name].
    The body is also the op's CPU and CUDA kernel (see _DIRECT_KERNELS), and its autograd
    kernel's for calls that need no gradient (_skip_autograd_without_grads)."""

    def define(fn):
        with adopt_cpp_definitions():
            op = triton_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        for dispatch_key in ("CPU", "CUDA"):
            _DIRECT_KERNELS.impl(name, fn, dispatch_key)
        _skip_autograd_without_grads(op, fn)
        if defined_schema(name) != SCHEMAS[name]:
            raise RuntimeError(
                f"{NAMESPACE}::{name}: the annotations of ops.{fn.__name__} give the schema "
                f"'{defined_schema(name)}', schemas.SCHEMAS says '{SCHEMAS[name]}': change both "
                f"(and csrc_stubs/tritonblas_stubs.cpp) together"
            )
        return op

    return define


@_triton_op("ws_mm")
def ws_mm(a: Tensor, b: Tensor) -> Tensor:
    """(M, K) @ (K, N) with the work-stealing kernel."""
    _check_operands("ws_mm", a, b, rank=2)
    if a.device.type == "cpu" and is_fake(a):
        return torch.mm(a, b)
    return ws_matmul(a, b)


@_triton_op("ws_addmm")
def ws_addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * bias + alpha * (a @ b), as torch.addmm; bias is added in the kernel's epilogue."""
    _check_operands("ws_addmm", a, b, rank=2)
    _check_bias(bias, a, b)
    if a.device.type == "cpu" and is_fake(a):
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    return ws_matmul(a, b, bias, alpha=alpha, beta=beta)


@_triton_op("ws_bmm")
def ws_bmm(a: Tensor, b: Tensor) -> Tensor:
    """(B, M, K) @ (B, K, N): every batch's tiles join one work-stealing queue."""
    _check_operands("ws_bmm", a, b, rank=3)
    if a.device.type == "cpu" and is_fake(a):
        return torch.bmm(a, b)
    return ws_matmul(a, b)


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes only, same checks (the default would run the body)
# ---------------------------------------------------------------------------------------


@ws_mm.register_fake
def _ws_mm_fake(a, b):
    _check_operands("ws_mm", a, b, rank=2)
    return a.new_empty((a.shape[0], b.shape[1]))


@ws_addmm.register_fake
def _ws_addmm_fake(bias, a, b, *, beta=1.0, alpha=1.0):
    _check_operands("ws_addmm", a, b, rank=2)
    _check_bias(bias, a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


@ws_bmm.register_fake
def _ws_bmm_fake(a, b):
    _check_operands("ws_bmm", a, b, rank=3)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


# ---------------------------------------------------------------------------------------
# Autograd: the gradients are GEMMs too, and go through the same kernel
# ---------------------------------------------------------------------------------------


def _save_operands(ctx, inputs, output):
    a, b = inputs[-2:]
    ctx.save_for_backward(a, b)


def _mm_grads(ctx, grad, matmul):
    a, b = ctx.saved_tensors
    needs_a, needs_b = ctx.needs_input_grad[-2:]
    grad_a = matmul(grad, b.mT) if needs_a else None
    grad_b = matmul(a.mT, grad) if needs_b else None
    return grad_a, grad_b


def _ws_mm_backward(ctx, grad):
    return _mm_grads(ctx, grad, torch.ops.tritonblas.ws_mm)


def _ws_bmm_backward(ctx, grad):
    return _mm_grads(ctx, grad, torch.ops.tritonblas.ws_bmm)


def _ws_addmm_setup(ctx, inputs, keyword_only_inputs, output):
    _save_operands(ctx, inputs, output)
    ctx.bias_shape = inputs[0].shape
    ctx.beta = keyword_only_inputs["beta"]
    ctx.alpha = keyword_only_inputs["alpha"]


def _ws_addmm_backward(ctx, grad):
    grad_a, grad_b = _mm_grads(ctx, grad, torch.ops.tritonblas.ws_mm)
    if grad_a is not None and ctx.alpha != 1:
        grad_a = grad_a * ctx.alpha
    if grad_b is not None and ctx.alpha != 1:
        grad_b = grad_b * ctx.alpha
    grad_bias = None
    if ctx.needs_input_grad[0]:
        # Reduce the broadcast gradient back to the bias's shape.
        grad_bias = (grad * ctx.beta if ctx.beta != 1 else grad).sum_to_size(ctx.bias_shape)
    return grad_bias, grad_a, grad_b


ws_mm.register_autograd(_ws_mm_backward, setup_context=_save_operands)
ws_bmm.register_autograd(_ws_bmm_backward, setup_context=_save_operands)
ws_addmm.register_autograd(_ws_addmm_backward, setup_context=_ws_addmm_setup)


"""torch.ops.tritonblas.ws_mm / ws_addmm / ws_bmm / ws_mm_act / ws_mm_gated: checks, kernels, fake
kernels, autograd.

Each op is a `triton_op`, so torch.compile sees the Triton kernel itself rather than an
opaque call. CPU tensors run the same kernel through Triton's interpreter (for tests and
demos, not speed); while CPU inputs are being traced, the body returns the aten result.

The schemas are also declared in C++ (csrc_stubs/, for processes without Python): they must
equal schemas.SCHEMAS, and when the C++ stubs were loaded first the ops below adopt the
C++ definitions instead of defining the ops again (schemas.py).
"""

import dataclasses

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad
from torch.library import triton_op

from tritonblas_ops import activations, fastpath
from tritonblas_ops.activations import ACTIVATIONS, GATE_FUNCTIONS
from tritonblas_ops.launch import PLAIN_TENSORS, launch_if_cached, ws_matmul
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
        type(a) in PLAIN_TENSORS and type(b) in PLAIN_TENSORS
        and a.layout == torch.strided and b.layout == torch.strided
        and a.dim() == rank and b.dim() == rank
        and a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES and a.device == b.device
        and a.shape[-1] == b.shape[-2] and (rank == 2 or a.shape[0] == b.shape[0])
    )


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


def bias_broadcasts(shape, out_shape) -> bool:
    """Whether a bias of `shape` broadcasts to the (M, N) output: at most 2-D, each of its
    sizes 1 or the output's."""
    return len(shape) <= 2 and all(
        size == 1 or size == out for size, out in zip(reversed(shape), reversed(out_shape)))


def _check_bias(bias: Tensor, a: Tensor, b: Tensor, op: str = "ws_addmm", name: str = "bias") -> None:
    out_shape = (a.shape[0], b.shape[1])
    if (type(bias) in PLAIN_TENSORS and bias.layout == torch.strided and bias.dtype == a.dtype
            and bias.device == a.device and bias_broadcasts(bias.shape, out_shape)):
        return  # every check below in one expression, for real tensors (the eager hot path)
    _check_tensor(op, name, bias)
    _check(
        bias.dtype == a.dtype,
        lambda: f"{op}: {name} must have the dtype of a and b ({a.dtype}), got {bias.dtype}",
    )
    _check(
        bias.device == a.device,
        lambda: f"{op}: {name} must be on {a.device}, got {bias.device}",
    )
    _check(
        bias_broadcasts(bias.shape, out_shape),
        lambda: f"{op}: {name} of shape {tuple(bias.shape)} does not broadcast to {out_shape}",
    )


def _check_activation(op: str, activation: str, allowed: tuple = ACTIVATIONS) -> None:
    _check(
        activation in allowed,
        lambda: f"{op}: activation must be one of {allowed}, got {activation!r}",
    )


def _check_mm_act(a: Tensor, b: Tensor, bias: Tensor | None, activation: str) -> None:
    _check_operands("ws_mm_act", a, b, rank=2)
    if bias is not None:
        _check_bias(bias, a, b, "ws_mm_act")
    _check_activation("ws_mm_act", activation)


def _check_mm_gated(a: Tensor, b: Tensor, gate: Tensor, activation: str) -> None:
    _check_operands("ws_mm_gated", a, b, rank=2)
    _check_bias(gate, a, b, "ws_mm_gated", "gate")
    _check_activation("ws_mm_gated", activation, GATE_FUNCTIONS)


# ---------------------------------------------------------------------------------------
# Autograd: the gradients are GEMMs too, and go through the same kernel. Reverse mode is
# custom_op's (register_autograd); forward mode (torch.func.jvp, forward_ad's dual
# tensors) and torch.func's transforms, which custom_op's kernel lacks, are added by our
# own autograd kernel below.
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


def _save_inputs_and_activation(ctx, inputs, keyword_only_inputs, output):
    """ws_mm_act's (a, b, bias) or ws_mm_gated's (a, b, gate), the activation and (ws_mm_act)
    alpha."""
    ctx.save_for_backward(*inputs)
    ctx.activation = keyword_only_inputs["activation"]
    ctx.alpha = keyword_only_inputs.get("alpha", 1.0)


def _preactivation_slope(a, b, bias, activation, alpha):
    """activation'(alpha * a @ b + bias), in fp32: the product recomputed, not kept from the
    forward (the fused op writes only the activated output)."""
    if bias is None:
        preactivation = torch.ops.tritonblas.ws_mm(a, b).float() * alpha
    else:
        preactivation = torch.ops.tritonblas.ws_addmm(bias, a, b, alpha=alpha).float()
    return activations.derivative(preactivation, activation)


def _ws_mm_act_backward(ctx, grad):
    a, b, bias = ctx.saved_tensors
    alpha = ctx.alpha
    if ctx.activation == "none":  # alpha * a @ b + bias (a residual fused): nothing to recompute
        grad_product = grad
    else:
        slope = _preactivation_slope(a, b, bias, ctx.activation, alpha)
        grad_product = (grad.float() * slope).to(grad.dtype)
    needs_a, needs_b, needs_bias = ctx.needs_input_grad
    grad_a = torch.ops.tritonblas.ws_mm(grad_product, b.mT) if needs_a else None
    grad_b = torch.ops.tritonblas.ws_mm(a.mT, grad_product) if needs_b else None
    if alpha != 1:  # as ws_addmm's backward: the scale after the GEMMs
        grad_a = grad_a * alpha if grad_a is not None else None
        grad_b = grad_b * alpha if grad_b is not None else None
    grad_bias = grad_product.sum_to_size(bias.shape) if needs_bias else None
    return grad_a, grad_b, grad_bias


def _ws_mm_gated_backward(ctx, grad):
    """out = act(gate) * p with p = a @ b (recomputed: the op writes only out)."""
    a, b, gate = ctx.saved_tensors
    needs_a, needs_b, needs_gate = ctx.needs_input_grad
    gate32 = gate.float()
    grad_product = (grad.float() * activations.apply(gate32, ctx.activation)).to(grad.dtype)
    grad_a = torch.ops.tritonblas.ws_mm(grad_product, b.mT) if needs_a else None
    grad_b = torch.ops.tritonblas.ws_mm(a.mT, grad_product) if needs_b else None
    grad_gate = None
    if needs_gate:
        product = torch.ops.tritonblas.ws_mm(a, b).float()
        grad_gate = (grad.float() * product * activations.derivative(gate32, ctx.activation))
        grad_gate = grad_gate.to(gate.dtype).sum_to_size(gate.shape)
    return grad_a, grad_b, grad_gate


def _ws_mm_gated_tangent(primals, tangents, keyword_only_args):
    a, b, gate = primals
    tangent_a, tangent_b, tangent_gate = tangents
    activation = keyword_only_args["activation"]
    out = None
    if tangent_a is not None or tangent_b is not None:
        tangent = _product_tangent(a, b, tangent_a, tangent_b, torch.ops.tritonblas.ws_mm)
        out = tangent.float() * activations.apply(gate.float(), activation)
    if tangent_gate is not None:
        product = torch.ops.tritonblas.ws_mm(a, b).float()
        part = product * activations.derivative(gate.float(), activation) * tangent_gate.float()
        out = part if out is None else out + part
    return out.to(a.dtype)


def _ws_mm_act_tangent(primals, tangents, keyword_only_args):
    a, b, bias = primals
    tangent_a, tangent_b, tangent_bias = tangents
    alpha = keyword_only_args.get("alpha", 1.0)
    parts = []
    if tangent_a is not None or tangent_b is not None:
        product = _product_tangent(a, b, tangent_a, tangent_b, torch.ops.tritonblas.ws_mm)
        parts.append(product * alpha if alpha != 1 else product)
    if tangent_bias is not None:
        parts.append(tangent_bias.expand(a.shape[0], b.shape[1]))
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    slope = _preactivation_slope(a, b, bias, keyword_only_args["activation"], alpha)
    return (tangent.float() * slope).to(tangent.dtype)


def _product_tangent(a, b, tangent_a, tangent_b, matmul):
    """d(a @ b) = da @ b + a @ db: the GEMM is bilinear."""
    parts = [matmul(tangent_a, b) if tangent_a is not None else None,
             matmul(a, tangent_b) if tangent_b is not None else None]
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _ws_mm_tangent(primals, tangents, keyword_only_args):
    return _product_tangent(*primals, *tangents, torch.ops.tritonblas.ws_mm)


def _ws_bmm_tangent(primals, tangents, keyword_only_args):
    return _product_tangent(*primals, *tangents, torch.ops.tritonblas.ws_bmm)


def _ws_addmm_tangent(primals, tangents, keyword_only_args):
    bias, a, b = primals
    tangent_bias, tangent_a, tangent_b = tangents
    beta, alpha = keyword_only_args["beta"], keyword_only_args["alpha"]
    out = None
    if tangent_a is not None or tangent_b is not None:
        out = alpha * _product_tangent(a, b, tangent_a, tangent_b, torch.ops.tritonblas.ws_mm)
    if tangent_bias is not None:
        bias_part = (beta * tangent_bias).expand(a.shape[0], b.shape[1])
        out = bias_part if out is None else out + bias_part
    return out


@dataclasses.dataclass
class _Call:
    keyset: torch._C.DispatchKeySet
    keyword_only_args: dict


def _with_forward_ad(op, setup_context, backward, tangent):
    """An autograd.Function computing the op with both derivatives: reverse mode by the
    op's registered formula, forward mode by `tangent`. Its last input is the call (_Call)."""
    overload = op._opoverload
    below_autograd = torch._C._after_autograd_keyset
    keyword_only = torch._library.utils.has_kwarg_only_args(overload._schema)

    def forward(*args):
        call = args[-1]
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(call.keyset & below_autograd, *args[:-1], **call.keyword_only_args)

    def setup(ctx, inputs, output):
        # The dispatcher drops arguments equal to their defaults: put them back.
        args, keyword_only_args = torch._library.utils.fill_defaults(
            overload._schema, inputs[:-1], inputs[-1].keyword_only_args)
        # Non-tensor arguments (a dtype) are passed on as None: the tangents take no others.
        ctx.save_for_forward(*(t if isinstance(t, Tensor) else None for t in args))
        if keyword_only:
            setup_context(ctx=ctx, inputs=args, keyword_only_inputs=keyword_only_args, output=output)
        else:
            setup_context(ctx=ctx, inputs=args, output=output)
        ctx.keyword_only_args = keyword_only_args

    def backward_(ctx, grad):
        needs_input_grad = ctx.needs_input_grad
        ctx.needs_input_grad = needs_input_grad[:-1]
        try:
            return (*backward(ctx, grad), None)
        finally:
            ctx.needs_input_grad = needs_input_grad

    def jvp(ctx, *tangents):
        return tangent(ctx.saved_tensors, tangents[:-1], ctx.keyword_only_args)

    # A _SingleLevelFunction, as torch.func builds its own: a Function's apply (Python in torch
    # 2.11 / 2.13, C++ in 2.14) hands calls made under torch.func's transforms to the
    # custom_function_call operator, which has no kernel at the autograd keys we run at.
    return type(f"ForwardAD_{op._name}", (torch.autograd.function._SingleLevelFunction,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(backward_), "jvp": staticmethod(jvp)})


def _has_tangent(args) -> bool:
    return any(isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in args)


_LIBRARY = torch.library.Library(NAMESPACE, "IMPL")


def _no_cached_launch(*args, **keyword_only_args) -> None:
    return None


def _register_autograd(op, body, setup_context, backward, tangent, cached_launch=_no_cached_launch) -> None:
    """register_autograd, plus an autograd kernel (AutogradCPU / AutogradCUDA) that handles
    forward mode and otherwise calls custom_op's own autograd kernel (fastpath.py may wrap
    it to skip autograd for calls that need no gradient, trying `cached_launch` first)."""
    op.register_autograd(backward, setup_context=setup_context)
    reverse = torch._library.autograd.make_autograd_impl(op._opoverload, op)
    dual = _with_forward_ad(op, setup_context, backward, tangent)

    def autograd_kernel(keyset, *args, **keyword_only_args):
        if ((forward_ad._current_level >= 0 and _has_tangent(args))
                or torch._C._are_functorch_transforms_active()):
            # Forward mode, or torch.func's transforms (grad, jacrev, vmap), which custom_op's
            # kernel does not support. Applied as a single-level Function from inside the
            # dispatcher: torch.func's own wrapper expects to be called above its transforms.
            with enable_single_level_autograd_function():
                return dual.apply(*args, _Call(keyset, keyword_only_args))
        return reverse(keyset, *args, **keyword_only_args)

    fast_body = fastpath.cached_launch_first(cached_launch, body)
    kernel = fastpath.skip_autograd_without_grads(autograd_kernel, fast_body)
    for dispatch_key in ("AutogradCPU", "AutogradCUDA"):
        _LIBRARY.impl(op._name, kernel, dispatch_key, with_keyset=True)
    fastpath.register_body(_LIBRARY, op._name, fast_body)


# ---------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------

def _triton_op(name: str, *, setup_context, backward, tangent, cached_launch):
    """`triton_op(f"tritonblas::{name}", mutates_args=())`, adopting the op if the C++ stubs
    already defined it (the schema torch infers from the annotations must be
    SCHEMAS[name]), with its derivatives in both modes and its cached launch
    (_register_autograd)."""

    def define(fn):
        with adopt_cpp_definitions():
            op = triton_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        if defined_schema(name) != SCHEMAS[name]:
            raise RuntimeError(
                f"{NAMESPACE}::{name}: the annotations of ops.{fn.__name__} give the schema "
                f"'{defined_schema(name)}', schemas.SCHEMAS says '{SCHEMAS[name]}': change both "
                f"(and csrc_stubs/tritonblas_stubs.cpp) together"
            )
        _register_autograd(op, fn, setup_context, backward, tangent, cached_launch)
        return op

    return define


# Each op's cached launch (launch.launch_if_cached), tried before its checks and body: the
# plan's key proves the operands as valid as those of the call that planned it, but not
# which op that was, so each checks what tells the ops apart (rank, activation).


def _ws_mm_cached(a, b):
    return launch_if_cached(a, b, None, 1.0, 1.0, "none", rank=2)


def _ws_addmm_cached(bias, a, b, *, beta=1.0, alpha=1.0):
    return launch_if_cached(a, b, bias, alpha, beta, "none", rank=2)


def _ws_bmm_cached(a, b):
    return launch_if_cached(a, b, None, 1.0, 1.0, "none", rank=3)


def _ws_mm_act_cached(a, b, bias, *, activation, alpha=1.0):
    if activation in ACTIVATIONS:
        return launch_if_cached(a, b, bias, alpha, 1.0, activation, rank=2)
    return None


def _ws_mm_gated_cached(a, b, gate, *, activation):
    if activation in GATE_FUNCTIONS:
        return launch_if_cached(a, b, gate, 1.0, 1.0, activations.GATE_PREFIX + activation, rank=2)
    return None


@_triton_op("ws_mm", setup_context=_save_operands, backward=_ws_mm_backward,
            tangent=_ws_mm_tangent, cached_launch=_ws_mm_cached)
def ws_mm(a: Tensor, b: Tensor) -> Tensor:
    """(M, K) @ (K, N) with the work-stealing kernel."""
    _check_operands("ws_mm", a, b, rank=2)
    if a.device.type == "cpu" and is_fake(a):
        return torch.mm(a, b)
    return ws_matmul(a, b)


@_triton_op("ws_addmm", setup_context=_ws_addmm_setup, backward=_ws_addmm_backward,
            tangent=_ws_addmm_tangent, cached_launch=_ws_addmm_cached)
def ws_addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * bias + alpha * (a @ b), as torch.addmm; bias is added in the kernel's epilogue."""
    _check_operands("ws_addmm", a, b, rank=2)
    _check_bias(bias, a, b)
    if a.device.type == "cpu" and is_fake(a):
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    return ws_matmul(a, b, bias, alpha=alpha, beta=beta)


@_triton_op("ws_bmm", setup_context=_save_operands, backward=_ws_bmm_backward,
            tangent=_ws_bmm_tangent, cached_launch=_ws_bmm_cached)
def ws_bmm(a: Tensor, b: Tensor) -> Tensor:
    """(B, M, K) @ (B, K, N): every batch's tiles join one work-stealing queue."""
    _check_operands("ws_bmm", a, b, rank=3)
    if a.device.type == "cpu" and is_fake(a):
        return torch.bmm(a, b)
    return ws_matmul(a, b)


@_triton_op("ws_mm_act", setup_context=_save_inputs_and_activation, backward=_ws_mm_act_backward,
            tangent=_ws_mm_act_tangent, cached_launch=_ws_mm_act_cached)
def ws_mm_act(a: Tensor, b: Tensor, bias: Tensor | None, *, activation: str, alpha: float = 1.0) -> Tensor:
    """activation(alpha * a @ b + bias) in one kernel: the epilogue scales, adds the bias and
    applies the activation (activations.ACTIVATIONS: relu, gelu, gelu_tanh, silu, none)
    before rounding. What routing's epilogue fusion puts in place of a GEMM and its
    activation, scale or residual add."""
    _check_mm_act(a, b, bias, activation)
    if a.device.type == "cpu" and is_fake(a):
        product = torch.mm(a, b) * alpha if bias is None else torch.addmm(bias, a, b, alpha=alpha)
        return activations.apply(product, activation)
    return ws_matmul(a, b, bias, alpha=alpha, activation=activation)


@_triton_op("ws_mm_gated", setup_context=_save_inputs_and_activation, backward=_ws_mm_gated_backward,
            tangent=_ws_mm_gated_tangent, cached_launch=_ws_mm_gated_cached)
def ws_mm_gated(a: Tensor, b: Tensor, gate: Tensor, *, activation: str) -> Tensor:
    """activation(gate) * (a @ b) in one kernel: a gated linear unit's product (SwiGLU is
    activation "silu"), the gate (broadcastable to the output, like a bias) read by the
    epilogue; with a slope ("d_gelu", "d_gelu_tanh", "d_silu") an activation's
    backward whose incoming gradient is a GEMM (d_gelu(h) * (dy @ w)). What epilogue fusion
    puts in place of a GLU's second GEMM and the product, or of a backward GEMM and the
    activation's backward."""
    _check_mm_gated(a, b, gate, activation)
    if a.device.type == "cpu" and is_fake(a):
        return activations.apply(gate, activation) * torch.mm(a, b)
    return ws_matmul(a, b, gate, activation=activations.GATE_PREFIX + activation)


# ---------------------------------------------------------------------------------------
# vmap (torch.func): the batch in one launch, where functorch's fallback would warn and
# call the op once per example. ws_mm_act and ws_mm_gated (routing's fused ops) keep it.
# ---------------------------------------------------------------------------------------


def _vmap_dim_first(x: Tensor, dim: int | None, size: int) -> Tensor:
    """x with the vmap dimension first: moved there, or a new one expanded to `size`."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _first_example(info, in_dims, *operands) -> list[Tensor] | None:
    """The first example's operands, for the op's own checks before a rule folds the batch
    into rows (which would accept an example of the wrong rank); None for an empty batch."""
    if info.batch_size == 0:
        return None
    return [x if dim is None else x.select(dim, 0) for x, dim in zip(operands, in_dims)]


@ws_mm.register_vmap
def _ws_mm_vmap(info, in_dims, a, b):
    if example := _first_example(info, in_dims, a, b):
        _check_operands("ws_mm", *example, rank=2)
    a_dim, b_dim = in_dims
    if b_dim is None:  # one weight: the examples' rows stack into one ws_mm
        a = a.movedim(a_dim, 0)
        return ws_mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:2], b.shape[1]), 0
    return ws_bmm(_vmap_dim_first(a, a_dim, info.batch_size), b.movedim(b_dim, 0)), 0


@ws_bmm.register_vmap
def _ws_bmm_vmap(info, in_dims, a, b):
    if example := _first_example(info, in_dims, a, b):
        _check_operands("ws_bmm", *example, rank=3)
    a, b = (_vmap_dim_first(x, dim, info.batch_size) for x, dim in zip((a, b), in_dims))
    out = ws_bmm(a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:]))
    return out.view(*a.shape[:2], *out.shape[1:]), 0


@ws_addmm.register_vmap
def _ws_addmm_vmap(info, in_dims, bias, a, b, *, beta=1.0, alpha=1.0):
    if example := _first_example(info, in_dims, bias, a, b):
        _check_operands("ws_addmm", *example[1:], rank=2)
        _check_bias(*example)
    bias_dim, a_dim, b_dim = in_dims
    size = info.batch_size
    if b_dim is None:  # one weight: the examples' rows stack into one ws_addmm
        a = _vmap_dim_first(a, a_dim, size)
        rows, n = a.shape[0] * a.shape[1], b.shape[1]
        if bias_dim is not None:  # each example's bias, broadcast over its rows
            bias = bias.movedim(bias_dim, 0)
            bias = bias.reshape(size, *(1,) * (3 - bias.dim()), *bias.shape[1:])
            bias = bias.expand(size, a.shape[1], n).reshape(rows, n)
        elif bias.dim() == 2 and bias.shape[0] != 1:  # a bias per row: every example's rows get it
            bias = bias.repeat(size, 1)
        out = ws_addmm(bias, a.reshape(rows, a.shape[-1]), b, beta=beta, alpha=alpha)
        return out.view(size, a.shape[1], n), 0
    # No batched addmm takes a weight per example: one call each, as the fallback would.
    bias, a, b = (_vmap_dim_first(x, dim, size) for x, dim in zip((bias, a, b), in_dims))
    return torch.stack([ws_addmm(bias[i], a[i], b[i], beta=beta, alpha=alpha) for i in range(size)]), 0


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


@ws_mm_act.register_fake
def _ws_mm_act_fake(a, b, bias, *, activation, alpha=1.0):
    _check_mm_act(a, b, bias, activation)
    return a.new_empty((a.shape[0], b.shape[1]))


@ws_mm_gated.register_fake
def _ws_mm_gated_fake(a, b, gate, *, activation):
    _check_mm_gated(a, b, gate, activation)
    return a.new_empty((a.shape[0], b.shape[1]))

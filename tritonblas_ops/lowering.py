"""torch.compile routing: Inductor lowers eligible GEMMs to the work-stealing kernel.

After AOTAutograd, the GEMMs a model spells `@`, torch.matmul, torch.mm / addmm / bmm,
nn.Linear or F.linear are aten.mm, aten.addmm or aten.bmm nodes, in the forward and the
backward graph alike (and a mixture-of-experts layer's torch._grouped_mm is
aten._grouped_mm). Inductor lowers each node through
`torch._inductor.lowering.lowerings[overload]`; `install()` wraps the entries of those four
`.default` overloads once, at import (registering on the overload packet silently does
nothing). The wrapper decides per GEMM, while the graph is being lowered: routed, or
Inductor's own lowering, called unchanged. Deciding then, not when torch.compile is called,
is what makes the backward follow: AOTAutograd compiles it lazily, at the first .backward().
Which GEMMs are eligible is settings.py's (the routing settings).

A routed GEMM becomes one of two things (settings' `path`):
- "opaque" (default): a call of torch.ops.tritonblas.ws_mm / ws_addmm / ws_bmm (an Inductor
  FallbackKernel; always so for ws_grouped_mm, whose tiles are counted on the GPU). The op
  plans its launch at run time, exactly as eagerly (TMA included), and pays the op's host
  time per GEMM.
- "inline": the kernel itself, a user-defined Triton kernel in the generated code, launched
  as plan.py plans it for the operands' layouts, with Inductor allocating the output, the
  zeroed counters (one buffer for all GEMMs of a graph) and the split-K workspace as its own
  buffers: no Python op call per GEMM.
  For static shapes the plan is the eager op's, so results are bitwise the op's. Operands
  move by TMA where Inductor keeps their bases 16-byte aligned: buffers it allocates, and
  graph inputs whose example was aligned (Inductor copies a later misaligned one before
  the call), at offsets known to keep that; by pointer loads otherwise. The programs make
  the tensor descriptors, except under CUDA graphs, where the generated code builds A's
  and B's on the host (a cost per call that the replays do not pay; torch 2.13 and later,
  _compat.HOST_DESCRIPTOR_ARGUMENTS). With symbolic sizes: one program per SM and whole-K
  tiles.
CPU tensors (only with settings' `cpu`, for tests and demos) take the opaque call, whose op
runs the kernel through Triton's interpreter: the inline kernel needs a device Triton
compiles for.

Caches: lowering overrides are not part of the FX-graph or AOTAutograd cache keys, so a
warm cache would serve code compiled under other settings. A post-grad pass, `_RoutingKey`,
sits in `config.post_grad_custom_post_pass` (after any pass the user set there) and puts the
settings into both keys through its uuid(); it changes the graph only when epilogue fusion
is on (fusion.py: a GEMM and its activation become one ws_mm_act call, the op form).

Not routed: torch.baddbmm (Inductor lowers aten.baddbmm itself; its bias has a batch
dimension the kernel's epilogue lacks), Inductor's fusion of two equal-shaped mm feeding an
add under max_autotune (mm_plus_mm, matched before lowering), and the int8 / fp8 / out_dtype
GEMMs, which are other ops.
"""

import functools
import importlib.metadata
import pathlib
import threading
import warnings
import weakref

import sympy
import torch
import triton
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.virtualized import V

from tritonblas_ops import _compat, fusion, policy, settings
from tritonblas_ops.activations import GATE_PREFIX, split_epilogue
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.ops import SUPPORTED_DTYPES
from tritonblas_ops.plan import Operand, OperandCopy, Outcome, plan, tf32_enabled
from tritonblas_ops.settings import Path, Policy

aten = torch.ops.aten
L = inductor_lowering.lowerings

# ---------------------------------------------------------------------------------------
# Which GEMMs are routed
# ---------------------------------------------------------------------------------------


def _shared_routes(batches: int, m: int, n: int, k: int) -> bool:
    """Policy "shared": whether the kernel is expected to come within ~10% of cuBLAS alone
    (and so beat it once other work holds SMs): on the H200 bf16 corpus every aligned shape
    with M, N >= 2048 did, smaller or unaligned ones lost (benchmarks/NOTES.md step 3)."""
    return (
        batches * m * n * k >= 2**34  # smaller: bound by the host's time per call
        and m >= 2048
        and n >= 2048
        and n % 16 == 0  # unaligned rows: pointer loads
        and k % 16 == 0
    )


def _eligible(a, b, bias, rank: int) -> bool:
    """Whether the kernel takes this GEMM (IR nodes of an mm/bmm, or of an addmm with bias).

    Decided from dtypes, devices and size hints only: never adds a guard.
    """
    if not settings.current().enabled:
        return False
    operands = [t for t in (a, b, bias) if t is not None]
    if len(a.get_size()) != rank or len(b.get_size()) != rank:
        return False
    hint = V.graph.sizevars.optimization_hint
    *batch, m, k = a.get_size()
    sizes = hint(batch[0]) if batch else 1, hint(m), hint(b.get_size()[-1]), hint(k)
    return (routable([t.get_device() for t in operands], [t.get_dtype() for t in operands], *sizes)
            and _cache_key_installed())


def routable(devices: list, dtypes: list, batches: int, m: int, n: int, k: int, *,
             saved_passes: int = 0, read_passes: int = 0, grouped: bool = False) -> bool:
    """The routing rules on what a GEMM's operands are (their devices and dtypes, the first
    A's) and its size hints: one supported dtype on one CUDA device (or the CPU with
    settings' cpu), something to compute, and the policy's choice (`saved_passes` and
    `read_passes`: the output-sized memory passes an epilogue fused into it saves, and the
    output-sized operands it reads, policy.py; `grouped`: a grouped GEMM)."""
    state = settings.current()
    device = devices[0]
    if device is None or device.type not in ("cuda", "cpu") or (device.type == "cpu" and not state.cpu):
        return False
    if any(d != device for d in devices) or any(t != dtypes[0] for t in dtypes):
        return False
    if dtypes[0] not in SUPPORTED_DTYPES:
        return False
    if batches * m * n == 0:
        return False  # nothing to compute
    # Batch invariance needs every GEMM on the kernel, whatever its M: cuBLAS picks its
    # reduction order by M.
    if state.policy is Policy.ALL or state.batch_invariant:
        return True
    if state.policy is Policy.SHARED:
        return _shared_routes(batches, m, n, k)
    return policy.faster(device, dtypes[0], batches, m, n, k, saved_passes=saved_passes,
                         read_passes=read_passes, grouped=grouped, tf32=tf32_enabled(),
                         graphed=inductor_config.triton.cudagraphs)


def _cache_key_installed() -> bool:
    if _KEY_PASS in _compat.post_grad_post_passes():
        return True
    _warn_cache_key_missing()
    return False


@functools.cache
def _warn_cache_key_missing() -> None:
    warnings.warn(
        "tritonblas_ops: config.post_grad_custom_post_pass no longer holds the routing "
        "cache-key pass, so compiled-code caches could not tell routing settings apart; GEMMs "
        "are left to Inductor. Keep tritonblas_ops.lowering.cache_key_pass() in that slot "
        "(beside your pass, in a list where torch accepts one) to route them.",
        stacklevel=2,
    )


# ---------------------------------------------------------------------------------------
# What a routed GEMM becomes
# ---------------------------------------------------------------------------------------


def _emit_opaque(op, *args, **kwargs):
    """A call of the torch.ops.tritonblas op in the generated code."""
    return inductor_lowering.fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)


@functools.cache
def _kernel_with_launch_config(num_warps: int, num_stages: int):
    # Inductor takes num_warps / num_stages of a user kernel from an autotuner's configs
    # (wrap_triton does the same with launch kwargs); one config means no autotuning.
    config = triton.Config({}, num_warps=num_warps, num_stages=num_stages)
    return triton.autotune(configs=[config], key=[])(ws_matmul_kernel)


def _fixed_layout(x):
    """A realized IR node whose strides are final (they become kernel arguments)."""
    x = ir.ExternKernel.realize_input(x)
    ir.as_storage_and_layout(x, freeze=True)
    return ir.TensorBox(x)


def _operand(x, element_size: int) -> Operand:
    """The Operand of a realized IR node: its base is aligned where Inductor keeps the
    buffer aligned and the view's offset is known to keep it so."""
    aligned = _compat.inductor_buffer_aligned(x.get_name())
    if aligned:
        offset = x.get_layout().offset * element_size
        aligned = V.graph.sizevars.statically_known_multiple_of(offset, 16)
    return Operand.of_layout(x.get_size(), x.get_stride(), element_size, aligned)


def _emit_inline(a, b, bias, alpha: float, beta: float, activation: str = "none"):
    """The kernel launch itself in the generated code, as the eager op would launch it on
    operands of these layouts (plan.py), Inductor's buffers in place of tensors; the
    epilogue applies `activation` (epilogue fusion's ws_mm_act)."""
    a, b = _fixed_layout(a), _fixed_layout(b)
    bias = _fixed_layout(bias) if bias is not None else None
    device, dtype = a.get_device(), a.get_dtype()
    element_size = dtype.itemsize
    sizes = [*a.get_size(), *b.get_size(), *(bias.get_size() if bias is not None else ())]
    sizevars = V.graph.sizevars
    the_plan = plan(
        _operand(a, element_size), _operand(b, element_size),
        Operand(tuple(bias.get_size()), tuple(bias.get_stride()), element_size, None)
        if bias is not None else None,
        batched=len(a.get_size()) == 3, dtype=dtype, device=device,
        alpha_zero=alpha == 0, beta_zero=beta == 0, tf32=dtype == torch.float32 and tf32_enabled(),
        traced=True, hint=sizevars.optimization_hint,
        batch_invariant=settings.current().batch_invariant,
        dynamic=not all(isinstance(s, (int, sympy.Integer)) for s in sizes),
        fits_int32=lambda offset: sizevars.statically_known_lt(offset, 2**31 - 1),
        activation=activation,
        graphed=inductor_config.triton.cudagraphs and _compat.HOST_DESCRIPTOR_ARGUMENTS,
    )
    out_shape = list(the_plan.out_shape)
    if the_plan.outcome is Outcome.EMPTY:
        return inductor_lowering.empty_strided(out_shape, None, dtype=dtype, device=device)
    if the_plan.outcome is Outcome.FILL:  # as the op: beta * bias, or zeros
        if activation != "none":  # K = 0 under an epilogue: rare enough for the op call
            base, gated = split_epilogue(activation)
            op = torch.ops.tritonblas.ws_mm_gated if gated else torch.ops.tritonblas.ws_mm_act
            return _emit_opaque(op.default, a, b, bias, activation=base,
                                **({"alpha": alpha} if alpha != 1 and not gated else {}))
        if the_plan.keep_bias:
            return L[aten.expand.default](L[aten.mul.Tensor](bias, beta), out_shape)
        return L[aten.full.default](out_shape, 0, dtype=dtype, device=device)
    planned_a, planned_b = the_plan.strides[:2]
    if the_plan.swap_ab:  # the plan's A is B^T and its B is A^T
        planned_a, planned_b = _transposed(planned_b), _transposed(planned_a)
    a = _copied(a, the_plan.copy_a, planned_a)
    b = _copied(b, the_plan.copy_b, planned_b)
    c = inductor_lowering.empty_strided(out_shape, None, dtype=dtype, device=device)
    counters = _shared_counters(the_plan.queue.numel, device)
    partials = (inductor_lowering.empty_strided([the_plan.partials_numel], None, dtype=torch.float32,
                                                device=device)
                if the_plan.partials_numel else None)
    a_arg, b_arg = (b, a) if the_plan.swap_ab else (a, b)
    descriptors, descriptor_metadata = (None, None, None), {}
    if the_plan.host_descriptors:
        descriptors, descriptor_metadata = _host_descriptors(the_plan, a_arg, b_arg)
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    # Added at every lowering: torch._dynamo.reset() empties the side table.
    kernel = _kernel_with_launch_config(the_plan.config.num_warps, the_plan.config.num_stages)
    _compat.user_defined_triton_kernel(
        kernel_idx=kernel_side_table.add_kernel(kernel),
        grid=[(the_plan.grid, 1, 1)],
        tma_descriptor_metadata=descriptor_metadata,
        kernel_args=the_plan.arguments(a_arg, b_arg, c, bias if the_plan.keep_bias else None,
                                       counters, partials, descriptors, alpha, beta),
    )
    return c


def _host_descriptors(the_plan, a, b) -> tuple:
    """Views of A and B laid out as the plan's tensor descriptors describe them, and the
    metadata by which Inductor builds their descriptors in the generated code before the
    launch (TensorDescriptor.from_tensor, the box as its block shape). C's descriptor stays
    the programs' (made from c_ptr): Inductor's analysis of what a kernel writes (torch
    2.13) does not see a store through a descriptor argument, and would drop the launch."""
    views, metadata = [], {}
    a_layout, b_layout, _ = the_plan.descriptor_layouts()
    for name, x, layout in (("a_desc", a, a_layout), ("b_desc", b, b_layout)):
        views.append(L[aten.as_strided.default](x, list(layout.shape), list(layout.strides)))
        metadata[name] = ("stable", (tuple(layout.box),))  # hashable: Inductor caches by it
    return (*views, None), metadata


_graph_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {device: buffer}
_graph_counters_lock = threading.Lock()


def _shared_counters(numel: int, device: torch.device):
    """Zeroed int32 counters for a routed GEMM of the graph being lowered. Every launch
    leaves its counters at zero (scheduler.py), and the graph's kernels run one after
    another on its stream, so its GEMMs share one buffer, zeroed once per run of the graph
    (under CUDA graphs, per replay) rather than by a fill kernel per GEMM. A GEMM that
    needs more counters than the shared buffer has (split-K's arrivals) starts a larger one,
    shared from there on. Inductor orders the kernels by their writes to it."""
    with _graph_counters_lock:
        shared = _graph_counters.setdefault(V.graph, {})
        if device not in shared or shared[device].get_numel() < numel:
            zeros = L[aten.full.default]([numel], 0, dtype=torch.int32, device=device)
            shared[device] = _fixed_layout(zeros)
        return shared[device]


def _copied(x, copy: OperandCopy, planned_stride: tuple):
    """x copied as the plan says (traced plans copy only to row-major), into the layout the
    plan launches with."""
    if copy is OperandCopy.NONE:
        return x
    assert copy is OperandCopy.CONTIGUOUS, copy
    x = _fixed_layout(ir.ExternKernel.copy_input(x))
    assert _operand(x, 1).stride[1:] == tuple(planned_stride)[1:], (x.get_stride(), planned_stride)
    return x


def _transposed(stride: tuple) -> tuple:
    return stride[0], stride[2], stride[1]


def _emit(op, a, b, bias=None, *, beta=1.0, alpha=1.0, activation=None, gated=False):
    """`gated`: bias is a gate (ws_mm_gated), which the inline kernel's epilogue multiplies by."""
    state = settings.current()
    device_type = a.get_device().type
    if state.path is Path.INLINE and (device_type == "cuda" or state.inline_cpu):
        epilogue = (GATE_PREFIX if gated else "") + (activation or "none")
        return _emit_inline(a, b, bias, float(alpha), float(beta), epilogue)
    if activation is not None:
        if alpha != 1:
            return _emit_opaque(op, a, b, bias, activation=activation, alpha=float(alpha))
        return _emit_opaque(op, a, b, bias, activation=activation)
    if bias is None:
        return _emit_opaque(op, a, b)
    return _emit_opaque(op, bias, a, b, beta=float(beta), alpha=float(alpha))


# ---------------------------------------------------------------------------------------
# The lowering overrides: return None to leave the GEMM to Inductor
# ---------------------------------------------------------------------------------------


def _route_mm(a, b):
    return _emit(torch.ops.tritonblas.ws_mm.default, a, b) if _eligible(a, b, None, rank=2) else None


def _route_addmm(bias, a, b, *, beta=1, alpha=1):
    if not _eligible(a, b, bias, rank=2):
        return None
    return _emit(torch.ops.tritonblas.ws_addmm.default, a, b, bias, beta=beta, alpha=alpha)


def _route_bmm(a, b):
    return _emit(torch.ops.tritonblas.ws_bmm.default, a, b) if _eligible(a, b, None, rank=3) else None


def _route_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None, layout=None):
    """aten._grouped_mm (mixture-of-experts GEMMs, forward and backward) becomes a call of
    ws_grouped_mm, which sizes its groups on the GPU: always the op form."""
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.get_dtype()):
        return None
    if not (settings.current().enabled and _cache_key_installed()):
        return None
    hint = V.graph.sizevars.optimization_hint
    a_sizes, b_sizes = [hint(s) for s in mat_a.get_size()], [hint(s) for s in mat_b.get_size()]
    # The GEMM as routing's rules see it: the ragged dimension whole, one batch per group
    # along K (where each group is a GEMM of the whole M and N).
    m, k, n = a_sizes[-2], a_sizes[-1], b_sizes[-1]
    batches = b_sizes[0] if len(a_sizes) == len(b_sizes) == 3 else 1
    if len(a_sizes) == len(b_sizes) == 2:
        batches, k = hint(offs.get_size()[0]), k // max(hint(offs.get_size()[0]), 1)
    devices = [t.get_device() for t in (mat_a, mat_b)]
    if not routable(devices, [mat_a.get_dtype(), mat_b.get_dtype()], batches, m, n, k, grouped=True):
        return None
    return _emit_opaque(torch.ops.tritonblas.ws_grouped_mm.default, mat_a, mat_b, offs)


_ROUTES = {aten.mm.default: _route_mm, aten.addmm.default: _route_addmm, aten.bmm.default: _route_bmm,
           aten._grouped_mm.default: _route_grouped_mm}


def _lower_mm_act(a, b, bias, *, activation, alpha=1.0):
    """ws_mm_act, which epilogue fusion puts in the graph (routing took its GEMM): the op
    call, or under the inline path the kernel with the scale, bias and activation in its
    epilogue."""
    return _emit(torch.ops.tritonblas.ws_mm_act.default, a, b, bias, activation=activation, alpha=alpha)


def _lower_mm_gated(a, b, gate, *, activation):
    """ws_mm_gated, which epilogue fusion puts in place of a GLU's second GEMM and product:
    the op call, or under the inline path the kernel with the gate in its epilogue."""
    return _emit(torch.ops.tritonblas.ws_mm_gated.default, a, b, gate, activation=activation, gated=True)


def _override(op, route):
    inductor_lowers = inductor_lowering.lowerings[op]

    def lower(*args, **kwargs):
        out = route(*args, **kwargs)
        return inductor_lowers(*args, **kwargs) if out is None else out

    lower.tritonblas_route = route
    return lower


# ---------------------------------------------------------------------------------------
# The cache key
# ---------------------------------------------------------------------------------------


class _RoutingKey(CustomGraphPass):
    """A post-grad pass whose uuid() is the routing settings, which puts them into the
    FX-graph and AOTAutograd cache keys (Inductor reads the uuid of every post-grad custom
    pass into both). It changes the graph only to fuse epilogues (fusion.py), when on."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fusion.fuse(graph)

    def uuid(self) -> str:
        return "|".join(("tritonblas_ops", _package_version(), _source_hash(),
                         repr(settings.current())))


_KEY_PASS = _RoutingKey()


def cache_key_pass() -> CustomGraphPass:
    """The pass that must stay in config.post_grad_custom_post_pass for routing to work."""
    return _KEY_PASS


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("tritonblas_ops")
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


@functools.cache
def _source_hash() -> str:
    """The package's source (kernel, plans, lowering): code compiled by another version of
    it, even an unreleased one, is never served."""
    sources = sorted(str(p) for p in pathlib.Path(__file__).parent.glob("*.py"))
    return get_hash_for_files(tuple(sources)).hex()


# ---------------------------------------------------------------------------------------
# Installation and the "tritonblas" backend
# ---------------------------------------------------------------------------------------


def install() -> None:
    """Wrap Inductor's mm / addmm / bmm / _grouped_mm lowerings, lower ws_mm_act and
    ws_mm_gated (epilogue fusion's ops) and add the cache-key pass; idempotent."""
    for op, route in _ROUTES.items():
        if getattr(inductor_lowering.lowerings[op], "tritonblas_route", None) is None:
            inductor_lowering.lowerings[op] = _override(op, route)
    inductor_lowering.lowerings[torch.ops.tritonblas.ws_mm_act.default] = _lower_mm_act
    inductor_lowering.lowerings[torch.ops.tritonblas.ws_mm_gated.default] = _lower_mm_gated
    if _KEY_PASS not in _compat.post_grad_post_passes():
        _compat.append_post_grad_post_pass(_KEY_PASS)


def tritonblas_backend(gm: torch.fx.GraphModule, example_inputs):
    """torch.compile(model, backend="tritonblas"): Inductor with routing on for this
    compile, whatever enable() / disable() say, the lazily compiled backward included.
    Registered through the `torch_dynamo_backends` entry point; importing this module
    installs the routing (the package's __init__ runs first)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(*args, **kwargs):
        with settings.routing(True):
            return compile_fx_inner(*args, **kwargs)

    with settings.routing(True):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

"""torch.compile routing: Inductor lowers eligible GEMMs to the work-stealing kernel.

After AOTAutograd, the GEMMs a model spells `@`, torch.matmul, torch.mm / addmm / bmm,
nn.Linear or F.linear are aten.mm, aten.addmm or aten.bmm nodes, in the forward and the
backward graph alike. Inductor lowers each node through
`torch._inductor.lowering.lowerings[overload]`; `install()` wraps the entries of those three
`.default` overloads once, at import (the overload packet is the wrong key: DESIGN.md 3).
The wrapper decides per GEMM, while the graph is being lowered: routed, or Inductor's own
lowering, called unchanged. Deciding then, not when torch.compile is called, is what makes
the backward follow: AOTAutograd compiles it lazily, at the first .backward().

A routed GEMM becomes one of two things, chosen by `TRITONBLAS_OPS_ROUTING_PATH`:
- "opaque" (default): a call of torch.ops.tritonblas.ws_mm / ws_addmm / ws_bmm (an Inductor
  FallbackKernel). The op picks its launch (tile config, TMA or pointer loads, grid) at run
  time, exactly as eagerly, but pays the op's host time per GEMM (~80 us on the H200).
- "inline": the kernel itself, a user-defined Triton kernel in the generated code, as
  `wrap_triton` would put it there: no Python op call per GEMM, and Inductor allocates the
  output and the zeroed counters as its own buffers. It always uses pointer loads (TMA needs
  the operands' base alignment, which the lowering cannot see without a guard) and whole-K
  tiles (split-K's workspace is sized by the tile count, which may be symbolic). Both forms
  pass the GPU tests on the H200; inline ran a compiled Llama block 2x faster than opaque
  but still slower than Inductor's own GEMMs (benchmarks/RESULTS.md). Make it the default
  once it uses TMA and beats opaque across the corpus.
CPU tensors (only after route_cpu(True), for tests and demos) always take the opaque call,
whose op runs the kernel through Triton's interpreter: the inline kernel needs a device
Triton compiles for.

Caches: lowering overrides are not part of the FX-graph or AOTAutograd cache keys, so a
warm cache would serve code compiled under another routing state. A post-grad pass that
changes nothing, `_RoutingKey`, sits in `config.post_grad_custom_post_pass` (after any pass
the user set there) and puts the state into both keys through its uuid().

Not routed: torch.baddbmm (Inductor lowers aten.baddbmm itself; its bias has a batch
dimension the kernel's epilogue lacks), Inductor's fusion of two equal-shaped mm feeding an
add under max_autotune (mm_plus_mm, matched before lowering), and the int8 / fp8 / out_dtype
GEMMs, which are other ops.

Already compiled graphs keep their code when the state changes: call torch._dynamo.reset()
(or compile anew) after enable() / disable() / set_policy() to recompile under the new state.
"""

import contextlib
import enum
import functools
import importlib.metadata
import os
import pathlib
import warnings

import sympy
import torch
import triton
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.virtualized import V

from tritonblas_ops import _compat
from tritonblas_ops import device as devices
from tritonblas_ops.config import num_tiles, select_config
from tritonblas_ops.kernel import counter_elements, kernel_arguments, tf32_enabled, ws_matmul_kernel
from tritonblas_ops.ops import SUPPORTED_DTYPES

aten = torch.ops.aten

ROUTING_ENV = "TRITONBLAS_OPS_ROUTING"  # "0" turns routing off at import
POLICY_ENV = "TRITONBLAS_OPS_POLICY"  # "all" (default) or "auto"
PATH_ENV = "TRITONBLAS_OPS_ROUTING_PATH"  # "opaque" (default) or "inline"


class Policy(enum.Enum):
    ALL = "all"  # every eligible GEMM
    AUTO = "auto"  # eligible GEMMs where the kernel is expected to win: _auto_routes


class Path(enum.Enum):
    OPAQUE = "opaque"  # a call of the torch.ops.tritonblas op
    INLINE = "inline"  # the Triton kernel in Inductor's generated code


# ---------------------------------------------------------------------------------------
# State, read from the environment once, at import
# ---------------------------------------------------------------------------------------


def _from_env(choice: type[enum.Enum], variable: str, default: enum.Enum) -> enum.Enum:
    value = os.environ.get(variable, default.value)
    try:
        return choice(value)
    except ValueError:
        allowed = ", ".join(repr(c.value) for c in choice)
        raise ValueError(f"{variable} must be one of {allowed}, got {value!r}") from None


_enabled = os.environ.get(ROUTING_ENV, "1") != "0"
_policy = _from_env(Policy, POLICY_ENV, Policy.ALL)
_path = _from_env(Path, PATH_ENV, Path.OPAQUE)

# Device types whose GEMMs are eligible ("cuda" is ROCm/HIP too). Tests add "cpu": the
# opaque op then runs the interpreter kernel, so routing can be proven without a GPU.
_eligible_devices = {"cuda"}
# Device types whose routed GEMMs may be inline: those Triton compiles for. Tests add "cpu"
# to check the inline code generation against a stand-in CUDA target (nothing runs).
_inline_devices = {"cuda"}


def enable() -> None:
    """Route eligible GEMMs of graphs compiled from now on through the kernel."""
    global _enabled
    _enabled = True


def disable() -> None:
    """Leave every GEMM of graphs compiled from now on to Inductor."""
    global _enabled
    _enabled = False


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def routing(enabled: bool):
    """Routing on or off for graphs compiled inside the block (a lazily compiled backward
    compiles at .backward(): call that inside the block too)."""
    global _enabled
    before = _enabled
    _enabled = enabled
    try:
        yield
    finally:
        _enabled = before


def route_cpu(enabled: bool) -> None:
    """Also route CPU GEMMs: compiled code then calls the ops, which run the kernel through
    Triton's interpreter. Slow; for tests and demos on machines without a GPU."""
    if enabled:
        _eligible_devices.add("cpu")
    else:
        _eligible_devices.discard("cpu")


def set_policy(policy: str) -> None:
    """"all": route every eligible GEMM; "auto": only those the kernel is expected to win."""
    global _policy
    _policy = Policy(policy)


def get_policy() -> str:
    return _policy.value


# ---------------------------------------------------------------------------------------
# Which GEMMs are routed
# ---------------------------------------------------------------------------------------


def _auto_routes(batches: int, m: int, n: int, k: int) -> bool:
    """Policy "auto": whether the kernel is expected to come within ~10% of cuBLAS alone
    (and so beat it once other work holds SMs).

    From the H200 bf16 corpus in benchmarks/RESULTS.md (run 6): every aligned shape with
    M, N >= 2048 ran at 0.89-1.02x; below that the kernel loses 2-20x.
    """
    return (
        batches * m * n * k >= 2**34  # sq2048 (2^33) ran at 0.27x: host-bound
        and m >= 2048  # M = 128 ran at 0.29-0.53x; M = 1024 with K = 16384 at 0.22x
        and n >= 2048
        and n % 16 == 0  # 3000 x 5000 x 2000 ran at 0.48x: unaligned rows, pointer loads
        and k % 16 == 0
    )


def _eligible(a, b, bias, rank: int) -> bool:
    """Whether the kernel takes this GEMM (IR nodes of an mm/bmm, or of an addmm with bias).

    Decided from dtypes, devices and size hints only: never adds a guard.
    """
    if not _enabled:
        return False
    operands = [t for t in (a, b, bias) if t is not None]
    device = a.get_device()
    if device is None or device.type not in _eligible_devices:
        return False
    if any(t.get_device() != device or t.get_dtype() != a.get_dtype() for t in operands):
        return False
    if a.get_dtype() not in SUPPORTED_DTYPES:
        return False
    if len(a.get_size()) != rank or len(b.get_size()) != rank:
        return False
    batches, m, n, k = _size_hints(a, b)
    if batches * m * n == 0:
        return False  # nothing to compute
    if _policy is Policy.AUTO and not _auto_routes(batches, m, n, k):
        return False
    return _cache_key_installed()


def _size_hints(a, b) -> tuple[int, int, int, int]:
    """(batches, M, N, K): exact for static shapes, the example's sizes for dynamic ones."""
    hint = V.graph.sizevars.optimization_hint
    *batch, m, k = a.get_size()
    n = b.get_size()[-1]
    return hint(batch[0]) if batch else 1, hint(m), hint(n), hint(k)


def _cache_key_installed() -> bool:
    if _KEY_PASS in _compat.post_grad_post_passes():
        return True
    _warn_cache_key_missing()
    return False


@functools.cache
def _warn_cache_key_missing() -> None:
    warnings.warn(
        "tritonblas_ops: config.post_grad_custom_post_pass no longer holds the routing "
        "cache-key pass, so compiled-code caches could not tell routing states apart; GEMMs "
        "are left to Inductor. Keep tritonblas_ops.routing.cache_key_pass() in that slot "
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


def _fixed_layout(x, unit_stride: bool):
    """A realized operand whose strides are final (they become kernel arguments).

    With `unit_stride`, one of its last two strides is 1: the kernel reads any strides, but
    with no unit stride every load would be a gather, so such a layout is copied (as the op
    does eagerly).
    """
    x = ir.ExternKernel.realize_input(x)
    _, layout = ir.as_storage_and_layout(x, freeze=True)
    if unit_stride and 1 not in layout.stride[-2:]:
        x = ir.ExternKernel.realize_input(ir.ExternKernel.copy_input(x))
        ir.as_storage_and_layout(x, freeze=True)
    return ir.TensorBox(x)


def _emit_inline(a, b, bias, alpha: float, beta: float):
    """The kernel launch itself in the generated code, as ops.ws_matmul launches it eagerly."""
    batched = len(a.get_size()) == 3
    a, b = _fixed_layout(a, unit_stride=True), _fixed_layout(b, unit_stride=True)
    *batch, m, k = a.get_size()
    n = b.get_size()[-1]
    device, dtype = a.get_device(), a.get_dtype()
    hint_batches, hint_m, hint_n, hint_k = _size_hints(a, b)
    # One K slice: split-K needs a workspace sized by the tile count, which may be symbolic;
    # and the operands as they are, with the tiles chosen for them.
    config = select_config(m=hint_m, n=hint_n, k=hint_k, batches=hint_batches, dtype=dtype,
                           device=device, allow_split_k=False, allow_swap_ab=False)

    c = inductor_lowering.empty_strided([*batch, m, n], None, dtype=dtype, device=device)
    num_shards = devices.default_num_shards(device)
    counters = inductor_lowering.lowerings[aten.full.default](
        [counter_elements(num_shards, 0, split_k=1)], 0, dtype=torch.int32, device=device
    )
    if bias is not None and beta == 0:
        bias = None  # torch.addmm ignores bias when beta == 0, NaN and Inf included
    if bias is not None:
        expanded = inductor_lowering.lowerings[aten.expand.default](bias, [m, n])
        bias = _fixed_layout(expanded, unit_stride=False)

    def strides(t):  # (batch, row, column) strides; a 2-D GEMM is one batch
        return t.get_stride() if batched else [0, *t.get_stride()]

    bias_strides = bias.get_stride() if bias is not None else (0, 0)  # (M, N) view
    operands = [t for t in (a, b, c, bias) if t is not None]
    fits_int32 = all(
        V.graph.sizevars.statically_known_lt(
            sum((size - 1) * stride for size, stride in zip(t.get_size(), t.get_stride())),
            2**31 - 1,
        )
        for t in operands
    )
    batches = batch[0] if batched else 1
    if all(isinstance(s, (int, sympy.Integer)) for s in (batches, m, n)):
        tiles = num_tiles(int(m), int(n), int(batches), config)
        num_programs = min(devices.num_compute_units(device), tiles)
    else:
        # Symbolic shape: one program per SM; programs that find no tile exit at once.
        num_programs = devices.num_compute_units(device)

    kernel_args = kernel_arguments(
        a, b, c, bias, counters, None, None, (None, None, None),
        sizes=(m, n, k, batches),
        strides=(strides(a), strides(b), strides(c), bias_strides),
        alpha=_scalar(alpha), beta=_scalar(beta), config=config, num_shards=num_shards,
        work_stealing=True,
        tf32=dtype == torch.float32 and tf32_enabled(),
        int64_index=not fits_int32,
        use_tma=False, a_row_major=False, b_row_major=False, tma_store=False,
    )
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    # Added at every lowering: torch._dynamo.reset() empties the side table.
    kernel = _kernel_with_launch_config(config.num_warps, config.num_stages)
    ir.UserDefinedTritonKernel(
        kernel_idx=kernel_side_table.add_kernel(kernel),
        grid=[(num_programs, 1, 1)],
        tma_descriptor_metadata={},
        kernel_args=kernel_args,
    )
    return c


def _scalar(value: float) -> int | float:
    """Inductor types a Python float argument as fp64 (codegen/triton_utils.signature_of), which
    would run the kernel's epilogue in fp64; integral alpha / beta (Linear's 1) go as ints."""
    return int(value) if value.is_integer() else value


def _emit(op, a, b, bias=None, *, beta=1.0, alpha=1.0):
    if _path is Path.INLINE and a.get_device().type in _inline_devices:
        return _emit_inline(a, b, bias, float(alpha), float(beta))
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


_ROUTES = {aten.mm.default: _route_mm, aten.addmm.default: _route_addmm, aten.bmm.default: _route_bmm}


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
    """A post-grad pass that changes nothing: its uuid() is the routing state, which puts
    that state into the FX-graph and AOTAutograd cache keys (Inductor reads the uuid of every
    post-grad custom pass into both)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "|".join((
            "tritonblas_ops",
            _package_version(),
            _source_hash(),
            f"enabled={_enabled}",
            f"policy={_policy.value}",
            f"path={_path.value}",
            f"devices={','.join(sorted(_eligible_devices))}",
            f"inline_devices={','.join(sorted(_inline_devices))}",
        ))


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
    """The package's source (kernel, configs, routing): code compiled by another version of
    it, even an unreleased one, is never served."""
    sources = sorted(str(p) for p in pathlib.Path(__file__).parent.glob("*.py"))
    return get_hash_for_files(tuple(sources)).hex()


# ---------------------------------------------------------------------------------------
# Installation and the "tritonblas" backend
# ---------------------------------------------------------------------------------------


def install() -> None:
    """Wrap Inductor's mm / addmm / bmm lowerings and add the cache-key pass; idempotent."""
    for op, route in _ROUTES.items():
        if getattr(inductor_lowering.lowerings[op], "tritonblas_route", None) is None:
            inductor_lowering.lowerings[op] = _override(op, route)
    if _KEY_PASS not in _compat.post_grad_post_passes():
        _compat.append_post_grad_post_pass(_KEY_PASS)


def tritonblas_backend(gm: torch.fx.GraphModule, example_inputs):
    """torch.compile(model, backend="tritonblas"): Inductor with routing on for this
    compile, whatever enable() / disable() say, the lazily compiled backward included.
    Registered through the `torch_dynamo_backends` entry point; importing this module
    installs the routing (the package's __init__ runs first)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(*args, **kwargs):
        with routing(True):
            return compile_fx_inner(*args, **kwargs)

    with routing(True):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

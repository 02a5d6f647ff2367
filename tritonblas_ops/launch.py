"""Executing launch plans on real (or traced) tensors: the eager launch, the cached fast
launch, and the interpreter for CPU tensors. Every decision is the plan's (plan.py); this
module only carries it out: copies the operands it names, allocates the output, the
counters (counters.py) and the split-K workspace, and launches the kernel the plan names
(kernel.py's, or warp_specialized_kernel.py's with Gluon's host descriptors).

Repeated eager calls with one shape, layout and alignment reuse the first call's plan and
compiled kernel (a cache of MAX_PLANS), launched through fastpath.py when it is on.
"""

import dataclasses
import functools
import os
import threading

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from tritonblas_ops import budget
from tritonblas_ops import counters as counter_pool
from tritonblas_ops import activations, fastpath, interpreter, relayout, settings
from tritonblas_ops.config import TileConfig
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.plan import (
    COPY_ROW_BYTES,
    DescriptorLayout,
    Kernel,
    Knobs,
    LaunchPlan,
    Operand,
    OperandCopy,
    Outcome,
    Schedule,
    plan,
    shard_setting,
    tf32_enabled,
)
from tritonblas_ops.warp_specialized_kernel import warp_specialized_matmul_kernel

CHECKED_ENV = "TRITONBLAS_OPS_CHECKED"
_checked = settings.parse_bool(CHECKED_ENV, os.environ.get(CHECKED_ENV, "0"))

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not fake, not functional: sizes are ints
_PLAIN = (*PLAIN_TENSORS, type(None))
MAX_PLANS = 1024


def set_checked(enabled: bool) -> None:
    """Checked launches (also TRITONBLAS_OPS_CHECKED=1): every eager launch outside a CUDA
    graph capture tallies its work units, and the host reads its counters back before and
    after it (a synchronization each) and raises RuntimeError, naming what it found, if
    they were not all zero before or if any unit was skipped, computed twice or left a
    counter set. Meant for tests and debugging: see benchmarks/RESULTS.md for its cost."""
    global _checked
    _checked = bool(enabled)


def is_checked() -> bool:
    return _checked


def ws_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    config: TileConfig | None = None,
    num_shards: int | None = None,
    num_programs: int | None = None,
    schedule: Schedule = Schedule.WORK_STEALING,
    use_tma: bool | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """activation(alpha * a @ b + beta * bias) for 2-D (M, K) @ (K, N) or 3-D (B, M, K) @
    (B, K, N), applied by the epilogue; activation one of activations.EPILOGUES, where
    "gate_<act>" makes it act(bias) * alpha * a @ b (the bias a gate of the output's shape).

    The plain Python entry point under the torch ops, with the knobs they keep at their
    defaults: tile config, shard count, grid size, schedule and load path. Inputs must
    already be valid (the ops check them). With the default knobs, repeated calls with one
    shape, layout and alignment reuse the first call's plan and compiled kernel.
    """
    alpha, beta = float(alpha), float(beta)  # one kernel signature, whatever the caller passed
    if (config is None and num_shards is None and num_programs is None and use_tma is None
            and schedule is Schedule.WORK_STEALING
            and type(a) in _PLAIN and type(b) in _PLAIN and type(bias) in _PLAIN):
        return _cached_call(a, b, bias, alpha, beta, activation)
    knobs = Knobs(config, num_shards, num_programs, schedule, use_tma)
    return execute(plan_for(a, b, bias, alpha, beta, knobs, activation=activation), a, b, bias, alpha, beta)[0]


def checking(t: torch.Tensor) -> bool:
    """Whether a launch on `t` now is checked: checked launches are on and no CUDA graph is
    being captured (a capture cannot read counters back)."""
    return _checked and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def plan_for(a, b, bias, alpha: float, beta: float, knobs: Knobs = Knobs(), *,
             out: torch.Tensor | None = None, activation: str = "none") -> LaunchPlan:
    """The plan of activation(alpha * a @ b + beta * bias) on these tensors (real or
    traced); `out`: a 3-D output view of another layout than a fresh one (tests)."""
    traced = is_fake(a)
    return plan(
        Operand.of(a, traced=traced), Operand.of(b, traced=traced),
        Operand.bias(bias, traced=traced) if bias is not None else None,
        batched=a.dim() == 3, dtype=a.dtype, device=a.device,
        alpha_zero=alpha == 0, beta_zero=beta == 0, tf32=a.dtype == torch.float32 and tf32_enabled(),
        knobs=knobs, traced=traced, checked=not traced and checking(a),
        batch_invariant=settings.current().batch_invariant,
        warp_specialize=settings.current().warp_specialize,
        max_programs=None if traced else budget.program_limit(a.device),
        live_budget=None if traced else budget.live_budget_word(a.device),
        out=Operand.of(out, traced=traced) if out is not None else None,
        activation=activation,
    )


# ---------------------------------------------------------------------------------------
# The eager launch
# ---------------------------------------------------------------------------------------


def execute(plan: LaunchPlan, a, b, bias, alpha: float, beta: float):
    """Carry out `plan` on the call's tensors. Returns the output, and for a launch on a GPU
    what it launched (Triton's compiled kernel, the arguments by name), else Nones."""
    if plan.compute_dtype != a.dtype:  # bf16 on the CPU: the interpreter's bf16 dot is wrong
        cast = [t.to(plan.compute_dtype) if t is not None else None for t in (a, b, bias)]
        out, _, _ = execute(plan, *cast, alpha, beta)
        return out.to(a.dtype), None, None
    out = torch.empty(plan.out_shape, dtype=a.dtype, device=a.device)
    if plan.outcome is Outcome.EMPTY:
        return out, None, None
    if plan.outcome is Outcome.FILL:
        product = torch.zeros(out.shape[-2:], dtype=a.dtype, device=a.device)
        out.copy_(activations.epilogue(product, bias.expand(out.shape[-2:]) if plan.keep_bias else None,
                                       beta, plan.activation))
        return out, None, None
    a_arg, b_arg, bias_arg, partials = operands(plan, a, b, bias)
    numel = plan.queue.numel
    if type(a) not in _PLAIN or a.device.type not in ("cuda", "cpu"):  # traced: zeros in the graph
        compiled, args = launch_kernel(plan, a_arg, b_arg, out, bias_arg, torch.zeros(
            numel, dtype=torch.int32, device=a.device), partials, alpha, beta)
        return out, compiled, args
    launched = on_counters(numel, a.device, lambda counters: _checked_launch(
        plan, a_arg, b_arg, out, bias_arg, counters, partials, alpha, beta))
    return (out, *launched) if a.is_cuda else (out, None, None)


def on_counters(numel: int, device: torch.device, launch):
    """launch(counters) on the pool's zeroed counters for `device` (counters.py), returning
    what it returns: on the CPU under the interpreter's lock (the buffer is shared: no other
    CPU launch until it is clean), re-zeroed if the launch raised midway; on a GPU with the
    device current (Triton launches there)."""
    if device.type == "cpu":
        with interpreter.LOCK:
            counters = counter_pool.zeroed(numel, device)
            try:
                return launch(counters)
            except BaseException:
                counters[:numel].zero_()  # a launch that raised midway may have left some set
                raise
    with fastpath.device_guard(device.index):
        return launch(counter_pool.zeroed(numel, device))


def operands(plan: LaunchPlan, a, b, bias) -> tuple:
    """(A, B, bias, partials) as the kernel gets them: copied as the plan says, swapped
    (only their data pointers matter: the plan holds the layouts)."""
    if plan.copy_a is not OperandCopy.NONE:
        a = copy_operand(a, plan.copy_a)
    if plan.copy_b is not OperandCopy.NONE:
        b = copy_operand(b, plan.copy_b)
    partials = (torch.empty(plan.partials_numel, dtype=torch.float32, device=a.device)
                if plan.partials_numel else None)
    a, b = (b, a) if plan.swap_ab else (a, b)
    return a, b, bias if plan.keep_bias else None, partials


def copy_operand(t: torch.Tensor, copy: OperandCopy) -> torch.Tensor:
    """t in the layout `copy` names (plan.Operand.copied says which strides that gives)."""
    if copy is OperandCopy.ROWS:
        per_line = COPY_ROW_BYTES // t.element_size()
        cols = t.shape[-1]
        padded = t.new_empty(*t.shape[:-1], -(-cols // per_line) * per_line)
        return relayout.copy_into(padded[..., :cols], t)
    if copy is OperandCopy.COLUMNS:
        return copy_operand(t.mT, OperandCopy.ROWS).mT
    if copy is OperandCopy.CONTIGUOUS:
        return t.contiguous()
    return t


_checked_lock = threading.Lock()  # a checked launch's reads and its launch, one at a time


def _checked_launch(plan: LaunchPlan, a, b, c, bias, counters, partials, alpha, beta):
    """launch_kernel, and for a checked plan the counters read back before and after (by
    one thread at a time: a buffer is shared by the launches of a stream)."""
    if not plan.checked:
        return launch_kernel(plan, a, b, c, bias, counters, partials, alpha, beta)
    return launch_and_check(
        plan.queue, counters, lambda: launch_kernel(plan, a, b, c, bias, counters, partials, alpha, beta),
        tally=plan.queue.num_units, what=f"a checked launch of {plan.sizes} (M, N, K, batches)")


def launch_and_check(queue, counters, launch, *, tally: int, what: str):
    """launch(), with `queue`'s counters read back before and after it (by one thread at a
    time: a buffer is shared by the launches of a stream); `tally`: the work units the
    launch must count. Raises RuntimeError naming what was found, after zeroing them."""
    numel = queue.numel
    with _checked_lock:
        found = queue.problems(counters[:numel].tolist())
        if found:
            counters[:numel].zero_()
            raise RuntimeError(f"tritonblas_ops: counters found in an impossible state before a "
                               f"launch (reset now): {'; '.join(found)}")
        launched = launch()
        found = queue.problems(counters[:numel].tolist(), tally=tally)
        counters[:numel].zero_()  # the tally, and anything left set
    if found:
        raise RuntimeError(f"tritonblas_ops: {what} went wrong: {'; '.join(found)}")
    return launched


def launch_kernel(plan: LaunchPlan, a, b, c, bias, counters, partials, alpha: float, beta: float,
                  *, unit_counts: torch.Tensor | None = None):
    """Launch the kernel as `plan` says on tensors already copied and swapped as it says.
    Returns what the launch gave (Triton's compiled kernel, on a GPU) and the arguments."""
    if plan.kernel is Kernel.WARP_SPECIALIZED:
        args = plan.warp_specialized_arguments(bias, counters, _gluon_descriptors(plan, a, b, c, bias), alpha, beta,
                                               unit_counts=unit_counts)
        return warp_specialized_matmul_kernel[(plan.grid,)](**args, **plan.launch_options), args
    descriptors = (None, None, None)
    if plan.host_descriptors:
        descriptors = _host_descriptors(plan, a, b, c)
    args = plan.arguments(a, b, c, bias, counters, partials, descriptors, alpha, beta,
                          unit_counts=unit_counts)
    if a.device.type == "cpu":
        kernel = interpreter.interpreted(ws_matmul_kernel)
    elif is_fake(a):
        kernel = wrap_triton(ws_matmul_kernel)  # traced: the kernel itself enters the graph
    else:
        kernel = ws_matmul_kernel  # eager: a direct launch (the traceable wrapper is slower)
    return kernel[(plan.grid,)](**args, **plan.launch_options), args


def _scratch_for_program_descriptors(*args, **kwargs) -> None:
    """Programs that make their own tensor descriptors need scratch memory from Triton's
    allocator when they run. Inductor sets one for its kernels; a traced graph run without
    Inductor (aot_eager, an exported program, opcheck), perhaps in autograd's thread, does
    not. So before any such launch through the jit function, in the launching thread, ours
    is set, only where no allocator is: one the application set stays. (Triton has no public
    way to read the allocator: triton.runtime._allocation.)"""
    bound = {**dict(zip(ws_matmul_kernel.arg_names, args)), **kwargs}
    program_descriptors = ((bound.get("USE_TMA") and bound.get("a_desc") is None)
                           or (bound.get("TMA_STORE") and bound.get("c_desc") is None))
    if program_descriptors:
        ensure_scratch_allocator()


def ensure_scratch_allocator() -> None:
    """Triton's allocator set to ours in this thread, unless the application set one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


ws_matmul_kernel.add_pre_run_hook(_scratch_for_program_descriptors)


def _host_descriptors(plan: LaunchPlan, a, b, c) -> tuple:
    """A's, B's and (under TMA_STORE) C's tensor descriptors, as the plan lays them out."""
    return tuple(host_descriptor(t, layout) if layout is not None else None
                 for t, layout in zip((a, b, c), plan.descriptor_layouts()))


def host_descriptor(base: torch.Tensor, layout: DescriptorLayout) -> TensorDescriptor:
    return TensorDescriptor(base, list(layout.shape), list(layout.strides), list(layout.box))


def gluon_descriptor(base: torch.Tensor, layout: DescriptorLayout) -> GluonTensorDescriptor:
    """A host descriptor for the warp-specialized kernel: the layout, with the NVMMA shared
    layout its box lands in (Gluon names it on the host)."""
    return GluonTensorDescriptor(base, list(layout.shape), list(layout.strides), list(layout.box),
                                 _shared_layout(layout.box, base.dtype))


def _gluon_descriptors(plan: LaunchPlan, a, b, c, bias) -> tuple:
    """A's, B's, C's and the prefetched bias's (else None) descriptors, as the plan lays them out."""
    return tuple(gluon_descriptor(t, layout) if layout is not None else None
                 for t, layout in zip((a, b, c, bias), (*plan.descriptor_layouts(), plan.bias_descriptor_layout())))


@functools.cache
def _shared_layout(box: tuple, dtype: torch.dtype):
    """The widest swizzle the box's rows allow: what wgmma and the TMA read fastest."""
    return gl.NVMMASharedLayout.get_default_for(list(box), {torch.bfloat16: gl.bfloat16,
                                                            torch.float16: gl.float16}[dtype])


# ---------------------------------------------------------------------------------------
# The cached launch: a call with the default knobs looks up what the first call with its
# key planned and compiled, and launches that directly (fastpath.CompiledLaunch), skipping
# planning and Triton's argument binding.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cached:
    plan: LaunchPlan
    # None: execute() every time (CPU, checked launches, fast paths off)
    launch: "fastpath.CompiledLaunch | None"
    counters_numel: int = 0


_cache: dict[tuple, _Cached] = {}
_cache_lock = threading.Lock()


def clear_plans() -> None:
    with _cache_lock:
        _cache.clear()


def cached_plans() -> list[LaunchPlan]:
    return [cached.plan for cached in list(_cache.values())]


def _plan_key(a, b, bias, alpha, beta, activation) -> tuple:
    """Everything a plan depends on besides the data: shapes, strides, dtypes, devices, the
    operands' 16-byte alignment (Triton specializes on it; so does the TMA choice), the
    bias's layout, the special values of alpha and beta, TF32, the shard setting, whether
    the launch is checked, batch invariance, the warp-specialized kernel's setting, the SM
    budgets (static and live), and the epilogue's activation. Every operand's dtype and
    device are in it, so a call that finds a plan is as valid as the call that made it."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.get_device(), b.get_device(),
            None if bias is None else (bias.shape, bias.stride(), bias.data_ptr() % 16, bias.dtype,
                                       bias.get_device()),
            a.data_ptr() % 16, b.data_ptr() % 16, alpha == 0, beta == 0,
            a.dtype == torch.float32 and tf32_enabled(), shard_setting(),
            checking(a),
            settings.current().batch_invariant, settings.current().warp_specialize,
            budget.key(a.get_device()), activation)


def _cached_call(a, b, bias, alpha: float, beta: float, activation: str = "none") -> torch.Tensor:
    key = _plan_key(a, b, bias, alpha, beta, activation)
    cached = _cache.get(key)
    if cached is None:
        the_plan = plan_for(a, b, bias, alpha, beta, activation=activation)
        out, compiled, args = execute(the_plan, a, b, bias, alpha, beta)
        _remember(key, the_plan, compiled, args, a.is_cuda)
        return out
    if cached.launch is None:
        return execute(cached.plan, a, b, bias, alpha, beta)[0]
    return _launch_cached(cached, a, b, bias, alpha, beta)


def launch_if_cached(a, b, bias, alpha: float, beta: float, activation: str, rank: int) -> torch.Tensor | None:
    """The output of a cached launch (fastpath.CompiledLaunch) where a plan for these
    arguments, `rank`-D, is cached, else None: the ops try this before their checks
    (fastpath.py), as the key proves the call as valid as the one that planned it."""
    if type(a) in PLAIN_TENSORS and type(b) in PLAIN_TENSORS and type(bias) in _PLAIN and a.dim() == rank:
        cached = _cache.get(_plan_key(a, b, bias, alpha, beta, activation))
        if cached is not None and cached.launch is not None:
            return _launch_cached(cached, a, b, bias, alpha, beta)
    return None


def _launch_cached(cached: _Cached, a, b, bias, alpha: float, beta: float) -> torch.Tensor:
    index = a.get_device()
    if fastpath.current_device() != index:  # Triton launches on the current device
        with fastpath.device_guard(index):
            return _launch_cached(cached, a, b, bias, alpha, beta)
    plan, device = cached.plan, a.device
    out = torch.empty(plan.out_shape, dtype=a.dtype, device=device)
    a_arg, b_arg, bias_arg, partials = operands(plan, a, b, bias)
    counters = counter_pool.zeroed(cached.counters_numel, device)
    cached.launch(plan.grid, fastpath.current_stream(index),
                  (a_arg, b_arg, out, bias_arg, counters, partials, plan.live_budget), alpha, beta)
    return out


def _remember(key: tuple, the_plan: LaunchPlan, compiled, args, on_gpu: bool) -> None:
    launch = None
    if the_plan.outcome is Outcome.LAUNCH and on_gpu and not the_plan.checked:
        kernel = warp_specialized_matmul_kernel if the_plan.kernel is Kernel.WARP_SPECIALIZED else ws_matmul_kernel
        launch = fastpath.compiled_launch(compiled, kernel.arg_names, args)
        if launch is None and fastpath.ENABLED:
            return  # not a compiled kernel (an asynchronous compile still running): next time
    with _cache_lock:
        if len(_cache) >= MAX_PLANS:
            _cache.pop(next(iter(_cache)), None)  # the oldest
        _cache[key] = _Cached(the_plan, launch, the_plan.queue.numel if the_plan.queue else 0)

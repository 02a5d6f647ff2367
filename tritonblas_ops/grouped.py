"""Grouped GEMMs (mixture-of-experts): torch.ops.tritonblas.ws_grouped_mm, with the
semantics of torch._grouped_mm, every group's tiles in one work-stealing queue.

`offs` holds the groups' ends (cumulative sizes, int32) along the dimension it splits:
- 2-D x 3-D, ragged M: A (T, K) holds the tokens sorted by group, B (G, K, N) a matrix per
  group, C (T, N) (the MoE forward). Rows past offs[-1] belong to no group: zeros.
- 3-D x 2-D, ragged N: A (G, M, K), B (K, T), C (M, T); columns past offs[-1]: zeros.
- 2-D x 2-D, ragged K: A (M, T), B (T, N), C (G, M, N) = A[:, group] @ B[group, :] (the
  weight gradient); an empty group's matrix is zeros.
- 3-D x 3-D: no offs, a bmm (ws_bmm's launch).
The kernel reads offs on the GPU (grouped_kernel.ws_grouped_kernel): no host sync, so a launch
can be captured in a CUDA graph. A malformed offs (decreasing, or outside [0, T]) is
clamped into disjoint groups and flagged in the launch's status; checked launches
(launch.set_checked) read offs first and raise naming what is wrong.

Each output tile is computed by one program over its whole K range in a fixed order, so
results are bitwise the same whatever the schedule and however many programs run.
"""

import dataclasses
import threading

import torch
import triton
from torch import Tensor

from tritonblas_ops import budget, interpreter, launch, settings
from tritonblas_ops import device as devices
from tritonblas_ops.device import COUNTER_STRIDE
from tritonblas_ops.config import WARP_SPECIALIZED_TILES, TileConfig, select_config
from tritonblas_ops.grouped_kernel import ws_grouped_kernel
from tritonblas_ops.ops import SUPPORTED_DTYPES, _check, _check_tensor, _register_autograd
from tritonblas_ops.plan import (
    Kernel, Operand, _describable, _max_offset, descriptor_layout, shard_setting, tf32_enabled,
    warp_specialized_arguments, warp_specialized_eligible,
)
from tritonblas_ops.warp_specialized_kernel import warp_specialized_matmul_kernel
from tritonblas_ops.scheduler import WorkQueue
from tritonblas_ops.schemas import NAMESPACE, SCHEMAS, adopt_cpp_definitions, defined_schema

OP = "ws_grouped_mm"


def ragged_dim(a: Tensor, b: Tensor) -> str | None:
    """Which dimension offs splits, from the operands' ranks: "m", "n", "k", or None (3-D x 3-D)."""
    return {(2, 3): "m", (3, 2): "n", (2, 2): "k", (3, 3): None}[(a.dim(), b.dim())]


def out_shape(a: Tensor, b: Tensor, offs: Tensor | None) -> tuple:
    ragged = ragged_dim(a, b)
    if ragged == "m":
        return a.shape[0], b.shape[2]
    if ragged == "n":
        return a.shape[1], b.shape[1]
    if ragged == "k":
        return offs.shape[0], a.shape[0], b.shape[1]
    return a.shape[0], a.shape[1], b.shape[2]


# ---------------------------------------------------------------------------------------
# Input checks (real and fake tensors: offs's values are not read here)
# ---------------------------------------------------------------------------------------


def check_inputs(a, b, offs, bias, out_dtype) -> None:
    _check_tensor(OP, "mat_a", a)
    _check_tensor(OP, "mat_b", b)
    for name, t in (("mat_a", a), ("mat_b", b)):
        _check(t.dim() in (2, 3), lambda: f"{OP}: {name} must be 2-D or 3-D, got shape {tuple(t.shape)}")
    _check(a.dtype == b.dtype, lambda: f"{OP}: mat_a and mat_b must have the same dtype, got {a.dtype} and {b.dtype}")
    _check(a.dtype in SUPPORTED_DTYPES,
           lambda: f"{OP}: dtype {a.dtype} is not supported; use float16, bfloat16 or float32")
    _check(a.device == b.device, lambda: f"{OP}: mat_a and mat_b must be on the same device, got {a.device} and {b.device}")
    _check(a.shape[-1] == b.shape[-2], lambda: f"{OP}: inner dimensions differ: mat_a is {tuple(a.shape)}, "
                                               f"mat_b is {tuple(b.shape)}")
    ragged = ragged_dim(a, b)
    if ragged is None:
        _check(offs is None, lambda: f"{OP}: offs must be None for 3-D x 3-D operands (a batched GEMM)")
        _check(a.shape[0] == b.shape[0], lambda: f"{OP}: batch sizes differ: mat_a is {tuple(a.shape)}, "
                                                 f"mat_b is {tuple(b.shape)}")
    else:
        _check(offs is not None, lambda: f"{OP}: offs (the groups' cumulative ends) is needed for "
                                         f"{a.dim()}-D x {b.dim()}-D operands")
        _check_tensor(OP, "offs", offs)
        _check(offs.dim() == 1 and offs.dtype == torch.int32,
               lambda: f"{OP}: offs must be a 1-D int32 tensor, got {offs.dtype} of shape {tuple(offs.shape)}")
        _check(offs.device == a.device, lambda: f"{OP}: offs must be on {a.device}, got {offs.device}")
        experts = {"m": ("mat_b", b), "n": ("mat_a", a)}.get(ragged)
        if experts is not None:
            name, t = experts
            _check(t.shape[0] == offs.shape[0],
                   lambda: f"{OP}: {name} has {t.shape[0]} groups but offs has {offs.shape[0]} ends")
    _check(bias is None, lambda: f"{OP}: bias is not supported (as for torch._grouped_mm)")
    _check(out_dtype is None or out_dtype == a.dtype,
           lambda: f"{OP}: out_dtype must be None or the inputs' dtype ({a.dtype}), got {out_dtype}")


def offs_problems(offs: list[int], extent: int) -> list[str]:
    """What is wrong with offs's values for a ragged dimension of `extent`, none if nothing."""
    found = []
    for i, end in enumerate(offs):
        if not 0 <= end <= extent:
            found.append(f"offs[{i}] = {end} is outside [0, {extent}]")
        elif i and end < offs[i - 1]:
            found.append(f"offs[{i}] = {end} is below offs[{i - 1}] = {offs[i - 1]}")
    return found


# ---------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedPlan:
    ragged: str  # "m", "n" or "k"
    config: TileConfig
    queue: WorkQueue
    grid: int
    use_tma: bool
    a_row_major: bool
    b_row_major: bool
    int64_index: bool
    input_precision: str
    sizes: tuple  # (M, N, K, groups), the ragged one whole
    strides: tuple  # A's, B's, C's (batch, row, column); 0 batch stride for a 2-D one
    groups_block: int
    checked: bool
    # Kernel.WARP_SPECIALIZED: groups along K (the weight gradient) on sm_90, the dense
    # warp-specialized kernel with offs: its loader reads each group's K range from the
    # operands' own descriptors (no descriptor per tile), and the next tile's loads run
    # during the epilogue, which is most of a short group's tile.
    kernel: Kernel = Kernel.TRITON


def _layout(t: Tensor) -> Operand:
    """(batch, rows, columns) with batch stride 0 for a 2-D tensor (the kernel's convention:
    along K the unit's batch is its group, which a 2-D operand must not move by)."""
    operand = Operand.of(t, traced=False)
    return dataclasses.replace(operand, stride=(0, *operand.stride[1:])) if t.dim() == 2 else operand


def plan_grouped(a: Tensor, b: Tensor, c: Tensor, num_groups: int, *, config: TileConfig | None = None,
                 num_programs: int | None = None, num_shards: int | None = None,
                 use_tma: bool | None = None) -> GroupedPlan:
    ragged = ragged_dim(a, b)
    la, lb, lc = _layout(a), _layout(b), _layout(c)
    m, k, n = la.shape[1], la.shape[2], lb.shape[2]
    device = a.device
    if config is None:
        # As for G GEMMs of the average group's size: the groups' sizes are on the GPU.
        groups = max(num_groups, 1)
        shape = {"m": (m // groups, n, k), "n": (m, n // groups, k), "k": (m, n, k // groups)}[ragged]
        config = select_config(*(max(s, 1) for s in shape), groups, a.dtype, device,
                               allow_split_k=False, allow_swap_ab=False)
    if config.split_k != 1 or config.swap_ab or config.k_chunks != 1:
        raise ValueError(f"{OP}: a grouped launch takes whole-K, unswapped tiles, got {config}")
    # Slots: a group's rows (columns) fill whole tile rows (columns) of their own; the tail
    # past offs[-1] is one more group.
    rows, cols = -(-m // config.block_m), -(-n // config.block_n)
    if ragged == "m":
        rows += num_groups + 1
    elif ragged == "n":
        cols += num_groups + 1
    max_units = rows * cols * (num_groups if ragged == "k" else 1)
    grid = num_programs or min(budget.program_limit(device), max_units)
    shards = devices.default_num_shards(device) if num_shards is None else num_shards
    # Tensor descriptors clip at the operand's edge, not at a group's end: along a ragged M
    # (N) the rows (columns) read past a group's end are another group's and not stored;
    # along K each unit describes its group's range, from a base that stays 16-byte aligned
    # only where K is no operand's unit stride (the weight gradient's x^T and dOut).
    # A box may start anywhere along a strided dimension but only on 16 bytes along the unit
    # one, and a group's rows (columns) start anywhere: the ragged dimension must not be the
    # unit stride either (torch._grouped_mm's own layouts: A row-major, B column-major).
    describable = k > 0 and _describable(la) and _describable(lb) and {
        "m": la.stride[2] == 1, "n": lb.stride[1] == 1,
        "k": la.stride[2] != 1 and lb.stride[2] == 1}[ragged]
    if use_tma is None:
        use_tma = devices.has_tma(device) and describable
    elif use_tma and not describable:
        raise ValueError(f"{OP}: use_tma=True needs 16-byte aligned operands with a unit stride, "
                         f"and the ragged dimension not the unit stride of either")
    int64_index = max(_max_offset(t.shape, t.stride) for t in (la, lb, lc)) >= 2**31 - 1
    queue = WorkQueue(shards, max_units, 1, 1, True)
    kernel = Kernel.TRITON
    if ragged == "k" and settings.current().warp_specialize and warp_specialized_eligible(
            device, a.dtype, config, queue, traced=False, host_descriptors=use_tma,
            tma_store=lc.stride[2] == 1 and _describable(lc), int64_index=int64_index):
        kernel = Kernel.WARP_SPECIALIZED
    return GroupedPlan(
        ragged=ragged, config=config, queue=queue, grid=max(grid, 1),
        use_tma=use_tma, a_row_major=la.stride[2] == 1, b_row_major=lb.stride[2] == 1,
        int64_index=int64_index,
        input_precision="tf32" if a.dtype == torch.float32 and a.is_cuda and tf32_enabled() else "ieee",
        sizes=(m, n, k, num_groups), strides=(la.stride, lb.stride, lc.stride),
        groups_block=triton.next_power_of_2(num_groups + 1),
        checked=launch.checking(a),
        kernel=kernel,
    )


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None, *, unit_counts: Tensor | None = None,
               **knobs) -> Tensor:
    """C = A @ B per group (the module's docstring): inputs already checked. knobs:
    plan_grouped's config, num_programs, num_shards, use_tma (tests)."""
    if offs is None:
        return launch.ws_matmul(a, b)
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:  # the interpreter's bf16 dot is wrong
        return grouped_mm(a.float(), b.float(), offs, unit_counts=unit_counts, **knobs).to(a.dtype)
    shape = out_shape(a, b, offs)
    num_groups = offs.shape[0]
    if num_groups == 0 or a.shape[-1] == 0 or 0 in shape:
        return a.new_zeros(shape)  # no group, or nothing to sum: every element a zero sum
    c = a.new_empty(shape)
    plan = plan_grouped(a, b, c, num_groups, **knobs) if knobs else _cached_plan(a, b, c, num_groups)
    offs = offs if offs.is_contiguous() else offs.contiguous()
    launch.on_counters(plan.queue.numel, a.device,
                       lambda counters: _launch(plan, a, b, c, offs, counters, unit_counts))
    return c


_plans: dict[tuple, GroupedPlan] = {}
_plans_lock = threading.Lock()


def _cached_plan(a: Tensor, b: Tensor, c: Tensor, num_groups: int) -> GroupedPlan:
    """plan_grouped's plan, looked up by everything it depends on besides the data (~30 us
    of host time a call saved): shapes, strides, dtype, device, the operands' 16-byte
    alignment, the group count, TF32, the shard setting, whether the launch is checked, and
    the SM budgets, the warp-specialized kernel's setting."""
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.get_device(), a.data_ptr() % 16,
           b.data_ptr() % 16, num_groups, a.dtype == torch.float32 and tf32_enabled(), shard_setting(),
           launch.checking(a), budget.key(a.get_device()), settings.current().warp_specialize)
    plan = _plans.get(key)
    if plan is None:
        plan = plan_grouped(a, b, c, num_groups)
        with _plans_lock:
            if len(_plans) >= launch.MAX_PLANS:
                _plans.pop(next(iter(_plans)), None)  # the oldest
            _plans[key] = plan
    return plan


def _launch(plan: GroupedPlan, a, b, c, offs, counters, unit_counts) -> None:
    """The kernel; a checked launch reads offs first, then checks as launch.py's do."""
    if not plan.checked:
        _launch_kernel(plan, a, b, c, offs, counters, unit_counts)
        return
    m, n, k, _ = plan.sizes
    ends = offs.tolist()
    found = offs_problems(ends, {"m": m, "n": n, "k": k}[plan.ragged])
    if found:
        raise RuntimeError(f"{OP}: offs must hold the groups' non-decreasing ends: {'; '.join(found)}")
    launch.launch_and_check(
        plan.queue, counters, lambda: _launch_kernel(plan, a, b, c, offs, counters, unit_counts),
        tally=num_units(plan, ends), what=f"a checked grouped launch of {plan.sizes} (M, N, K, groups)")


def num_units(plan: GroupedPlan, ends: list[int]) -> int:
    """The work units a launch computes for valid offs `ends`, as the kernel counts them."""
    m, n, k, groups = plan.sizes
    bm, bn = plan.config.block_m, plan.config.block_n
    if plan.ragged == "k":
        return groups * -(-m // bm) * -(-n // bn)
    extent, block, other = (m, bm, -(-n // bn)) if plan.ragged == "m" else (n, bn, -(-m // bm))
    bounds = [0, *ends, extent]
    slots = sum(-(-(end - begin) // block) for begin, end in zip(bounds, bounds[1:]))
    return slots * other


def _launch_kernel(plan: GroupedPlan, a, b, c, offs, counters, unit_counts) -> None:
    m, n, k, groups = plan.sizes
    (sab, sam, sak), (sbb, sbk, sbn), (scb, scm, scn) = plan.strides
    config = plan.config
    if plan.kernel is Kernel.WARP_SPECIALIZED:
        _launch_warp_specialized(plan, a, b, c, offs, counters, unit_counts)
        return
    a_desc = b_desc = None
    if plan.use_tma and plan.ragged == "k":
        launch.ensure_scratch_allocator()  # for the programs' descriptors
    elif plan.use_tma:
        a_desc = launch.host_descriptor(a, descriptor_layout((a.shape[0] if a.dim() == 3 else 1, m, k),
                                                             (sab, sam, sak), config.block_m, config.block_k))
        b_desc = launch.host_descriptor(b, descriptor_layout((b.shape[0] if b.dim() == 3 else 1, k, n),
                                                             (sbb, sbk, sbn), config.block_k, config.block_n))
    kernel = interpreter.interpreted(ws_grouped_kernel) if a.device.type == "cpu" else ws_grouped_kernel
    kernel[(plan.grid,)](
        a, b, c, offs, counters, unit_counts, budget.live_budget_word(a.device),
        a_desc, b_desc, m, n, k, groups,
        sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        NUM_SHARDS=plan.queue.num_shards, COUNTER_STRIDE=COUNTER_STRIDE,
        CHECKED=plan.checked, INPUT_PRECISION=plan.input_precision, INT64_INDEX=plan.int64_index,
        USE_TMA=plan.use_tma, A_ROW_MAJOR=plan.a_row_major, B_ROW_MAJOR=plan.b_row_major,
        RAGGED=plan.ragged, GROUPS_BLOCK=plan.groups_block,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _launch_warp_specialized(plan: GroupedPlan, a, b, c, offs, counters, unit_counts) -> None:
    """Groups along K on the warp-specialized kernel: A (M, K) and B (K, N) described whole
    (a tile's K range is its group's: the kernel starts its boxes at the group's begin and
    zeros what the last one reads past its end), C (groups, M, N) one batch per group."""
    m, n, k, groups = plan.sizes
    (_, sam, sak), (_, sbk, sbn), (scb, scm, scn) = plan.strides
    config = plan.config
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    variant = WARP_SPECIALIZED_TILES[(bm, bn, bk)]
    a_desc = launch.gluon_descriptor(a, descriptor_layout((1, m, k), (0, sam, sak), bm, bk))
    b_desc = launch.gluon_descriptor(b, descriptor_layout((1, k, n), (0, sbk, sbn), bk, bn))
    c_desc = launch.gluon_descriptor(c, descriptor_layout((groups, m, n), (scb, scm, scn), bm, variant.epilogue_n))
    args = warp_specialized_arguments(
        (a_desc, b_desc, c_desc, None), sizes=plan.sizes, config=config, variant=variant,
        num_shards=plan.queue.num_shards, checked=plan.checked, a_row_major=plan.a_row_major,
        b_row_major=plan.b_row_major, counters=counters, live_budget=budget.live_budget_word(a.device),
        unit_counts=unit_counts, offs=offs, groups_block=plan.groups_block)
    warp_specialized_matmul_kernel[(plan.grid,)](**args, **variant.launch_options)


# ---------------------------------------------------------------------------------------
# The op: kernel, fake kernel, autograd
# ---------------------------------------------------------------------------------------


def _define(fn):
    """The custom op, adopting the C++ stubs' definition, with its derivatives in both modes
    (ops._register_autograd)."""
    with adopt_cpp_definitions():
        op = torch.library.custom_op(f"{NAMESPACE}::{OP}", mutates_args=(), tags=(torch.Tag.pt2_compliant_tag,))(fn)
    if defined_schema(OP) != SCHEMAS[OP]:
        raise RuntimeError(f"{NAMESPACE}::{OP}: the annotations give '{defined_schema(OP)}', "
                           f"schemas.SCHEMAS says '{SCHEMAS[OP]}': change both (and the C++ stubs)")
    _register_autograd(op, fn, _setup, _backward, _tangent)
    return op


def _setup(ctx, inputs, output):
    mat_a, mat_b, offs = inputs[:3]
    ctx.save_for_backward(mat_a, mat_b, offs)


def _backward(ctx, grad):
    """C = A @ B per group is bilinear, and the gradients are grouped GEMMs with the same
    offs whatever the layout: dA = dC @ B^T and dB = A^T @ dC, each along the dimension
    that offs splits there (ragged M's dA is ragged M, its dB ragged K; and so on)."""
    mat_a, mat_b, offs = ctx.saved_tensors
    needs_a, needs_b = ctx.needs_input_grad[:2]
    grad_a = ws_grouped_mm(grad, mat_b.mT, offs) if needs_a else None
    grad_b = ws_grouped_mm(mat_a.mT, grad, offs) if needs_b else None
    return grad_a, grad_b, None, None, None


def _tangent(primals, tangents, keyword_only_args):
    """dC = dA @ B + A @ dB per group, with the same offs (forward mode)."""
    mat_a, mat_b, offs = primals[:3]
    tangent_a, tangent_b = tangents[:2]
    parts = [ws_grouped_mm(tangent_a, mat_b, offs) if tangent_a is not None else None,
             ws_grouped_mm(mat_a, tangent_b, offs) if tangent_b is not None else None]
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


@_define
def ws_grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> Tensor:
    """torch._grouped_mm with every group's tiles in one work-stealing queue (module docstring)."""
    check_inputs(mat_a, mat_b, offs, bias, out_dtype)
    return grouped_mm(mat_a, mat_b, offs)


@ws_grouped_mm.register_fake
def _ws_grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    check_inputs(mat_a, mat_b, offs, bias, out_dtype)
    return mat_a.new_empty(out_shape(mat_a, mat_b, offs))


"""Launch planning: every decision a GEMM launch makes, taken once, from what the operands
look like (shapes, strides, dtype, device, alignment) and the switches, into a frozen
LaunchPlan. The executors (launch.py eagerly, lowering.py in Inductor's generated code)
carry a plan out and decide nothing themselves, so the same operands always launch the
same kernel the same way, whoever launches it.
"""

import dataclasses
import enum
import os
from typing import Callable

import torch

from tritonblas_ops import device as devices
from tritonblas_ops import scheduler
from tritonblas_ops.activations import EPILOGUES, split_epilogue
from tritonblas_ops.config import (
    WARP_SPECIALIZED_TILES,
    TileConfig,
    WarpSpecializedVariant,
    fits_chunked,
    num_tiles,
    select_config,
    select_invariant_config,
)
from tritonblas_ops.scheduler import WorkQueue


class Schedule(enum.Enum):
    WORK_STEALING = "work_stealing"  # units claimed from sharded atomic counters
    STATIC = "static"  # program p takes units p, p + grid, ...: the baseline we beat


class Kernel(enum.Enum):
    """Which kernel a launch runs."""
    TRITON = "triton"  # kernel.ws_matmul_kernel: any launch
    # warp_specialized_kernel (Gluon, Hopper only): the same bits for the launches it takes
    # (warp_specialized_eligible), with the loads of the next tile overlapping the epilogue
    WARP_SPECIALIZED = "warp_specialized"


class Outcome(enum.Enum):
    LAUNCH = "launch"  # the kernel computes the output
    EMPTY = "empty"  # the output has no elements
    FILL = "fill"  # no product to compute (K = 0, or alpha = 0): zeros, or beta * bias


class OperandCopy(enum.Enum):
    """How an operand reaches the kernel: as it is, or copied first."""
    NONE = "none"
    ROWS = "rows"  # row-major, each row padded to whole COPY_ROW_BYTES lines
    COLUMNS = "columns"  # column-major, each column padded likewise
    CONTIGUOUS = "contiguous"  # row-major (no unit stride: every load would be a gather)


# Under the static schedule a split-K tile's last slice sums every partial alone; work
# stealing spreads the sums over all programs but pays more atomic round trips on the way.
# On one-wave H200 launches the static sum won up to this many bytes of partials per tile
# and lost above (benchmarks/NOTES.md step 14).
LAST_SLICE_SUM_MAX_BYTES = 256 * 1024

# A copy that aligns an operand's rows for tensor descriptors reads and writes it once; it
# pays when the GEMM does at least this many FLOPs per byte copied (NOTES.md step 6).
ALIGN_MIN_FLOPS_PER_BYTE = 200
# Under TF32 a K-major copy makes the GEMM itself several times faster (wgmma reads TF32
# only K-major), so copies pay from far smaller GEMMs (NOTES.md step 11).
TF32_COPY_MIN_FLOPS_PER_BYTE = 64
# Copies pad rows to whole 128-byte lines, not to the 16 bytes descriptors need: a box row
# that starts mid-line touches two lines (NOTES.md step 16).
COPY_ROW_BYTES = 128

@dataclasses.dataclass(frozen=True)
class Operand:
    """What planning needs of a (B, rows, cols) operand (or of a bias: see bias()). Sizes
    and strides are ints, SymInts (traced) or sympy expressions (Inductor)."""
    shape: tuple
    stride: tuple
    element_size: int
    aligned: bool | None  # its base address is 16-byte aligned; None: not known

    @classmethod
    def bias(cls, t: torch.Tensor, *, traced: bool = False) -> "Operand":
        """A bias as it is: any shape that broadcasts to (M, N); its base's alignment is
        known for a real tensor only."""
        return cls(tuple(t.shape), tuple(t.stride()), t.element_size(), None if traced else t.data_ptr() % 16 == 0)

    @classmethod
    def of(cls, t: torch.Tensor, *, traced: bool) -> "Operand":
        """While tracing there is no data pointer: the allocator aligns storages to far more
        than 16 bytes, so the view's offset decides."""
        base = t.storage_offset() * t.element_size() if traced else t.data_ptr()
        return cls.of_layout(t.shape, t.stride(), t.element_size(), base % 16 == 0)

    @classmethod
    def of_layout(cls, shape, stride, element_size: int, aligned: bool | None) -> "Operand":
        """A (B, rows, cols) or (rows, cols) layout; a 2-D one is one batch (as unsqueeze(0))."""
        shape, stride = tuple(shape), tuple(stride)
        if len(shape) == 2:
            shape, stride = (1, *shape), (shape[0] * stride[0], *stride)
        return cls(shape, stride, element_size, aligned)

    def transposed(self) -> "Operand":
        (b, r, c), (sb, sr, sc) = self.shape, self.stride
        return Operand((b, c, r), (sb, sc, sr), self.element_size, self.aligned)

    def copied(self, copy: OperandCopy) -> "Operand":
        """The layout `copy` gives it (launch.copy_operand makes exactly this)."""
        (_, r, c), size = self.shape, self.element_size
        if copy is OperandCopy.ROWS:
            padded = _round_up(c, COPY_ROW_BYTES // size)
            return Operand(self.shape, (r * padded, padded, 1), size, True)
        if copy is OperandCopy.COLUMNS:
            return self.transposed().copied(OperandCopy.ROWS).transposed()
        if copy is OperandCopy.CONTIGUOUS:
            return Operand(self.shape, (r * c, c, 1), size, True)
        return self


@dataclasses.dataclass(frozen=True)
class Knobs:
    """ws_matmul's keyword knobs; None lets the planner choose."""
    config: TileConfig | None = None
    num_shards: int | None = None
    num_programs: int | None = None
    schedule: Schedule = Schedule.WORK_STEALING
    use_tma: bool | None = None
    # None: descriptors built on the host for eager launches, by each program for traced
    # ones; False makes eager launches build them in the programs too (tests).
    host_descriptors: bool | None = None


_DEFAULT_KNOBS = Knobs()


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    outcome: Outcome
    out_shape: tuple  # the output's shape: (M, N), or (B, M, N) for 3-D operands
    compute_dtype: torch.dtype  # the operands' dtype, or fp32 where it must stand in (CPU bf16)
    keep_bias: bool  # False when beta == 0: torch.addmm ignores the bias then, NaN included
    copy_a: OperandCopy = OperandCopy.NONE
    copy_b: OperandCopy = OperandCopy.NONE
    # Launch C^T = B^T @ A^T: the kernel gets B^T as A, A^T as B and C^T as C (the sizes
    # and strides below are the launch's, already swapped).
    swap_ab: bool = False
    config: TileConfig | None = None
    queue: WorkQueue | None = None
    grid: int = 0
    use_tma: bool = False
    host_descriptors: bool = False
    a_row_major: bool = False  # under TMA: how each operand's descriptor describes it
    b_row_major: bool = False
    tma_store: bool = False
    int64_index: bool = False
    input_precision: str = "ieee"
    sizes: tuple = ()  # (M, N, K, batches) as launched
    strides: tuple = ()  # A's, B's, C's (batch, row, column) and the bias's (row, column)
    partials_numel: int = 0
    max_spins: int = 0
    checked: bool = False
    # int32 (1,) on the device: budget.LiveBudget's word, read by the programs between
    # units (those at or above it leave), or None
    live_budget: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    activation: str = "none"  # the epilogue's: one of activations.EPILOGUES
    kernel: Kernel = Kernel.TRITON
    # The warp-specialized kernel's loader reads the bias, an (M, N) operand with unit
    # column stride (a gate, a residual), into shared memory during the K loop.
    prefetch_bias: bool = False

    def arguments(self, a, b, c, bias, counters, partials, descriptors, alpha, beta, *,
                  unit_counts=None, sizes=None, strides=None) -> dict:
        """ws_matmul_kernel's arguments by name, in its order: the plan's, with the call's
        tensors (or Inductor's buffers) and scalars. `descriptors`: A's, B's and C's host-built
        tensor descriptors, each None when the programs make them; `sizes` and `strides`
        replace the plan's where they are symbolic (Inductor)."""
        m, n, k, batches = sizes or self.sizes
        stride_a, stride_b, stride_c, stride_bias = strides or self.strides
        a_desc, b_desc, c_desc = descriptors
        config = self.config
        return dict(
            a_ptr=a, b_ptr=b, c_ptr=c, bias_ptr=bias, counters_ptr=counters,
            partials_ptr=partials, unit_counts_ptr=unit_counts, budget_ptr=self.live_budget,
            a_desc=a_desc, b_desc=b_desc, c_desc=c_desc,
            M=m, N=n, K=k, num_batches=batches,
            stride_ab=stride_a[0], stride_am=stride_a[1], stride_ak=stride_a[2],
            stride_bb=stride_b[0], stride_bk=stride_b[1], stride_bn=stride_b[2],
            stride_cb=stride_c[0], stride_cm=stride_c[1], stride_cn=stride_c[2],
            stride_bias_m=stride_bias[0], stride_bias_n=stride_bias[1],
            alpha=alpha, beta=beta, max_spins=self.max_spins, whole_tiles=self.queue.whole_tiles,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, SPLIT_K=config.split_k,
            # split: a slice is a chunk; a split tail's whole tiles sum the chunks in turn
            K_CHUNKS=config.k_chunks if config.split_k == 1 or config.split_tail else 1,
            SUM_ROWS=config.sum_rows,
            **self.queue.kernel_constants(),
            CHECKED=self.checked,
            INPUT_PRECISION=self.input_precision,
            INT64_INDEX=self.int64_index,
            USE_TMA=self.use_tma, A_ROW_MAJOR=self.a_row_major, B_ROW_MAJOR=self.b_row_major,
            TMA_STORE=self.tma_store,
            **_epilogue_constants(self.activation),
        )

    def warp_specialized_arguments(self, bias, counters, descriptors, alpha, beta, *, unit_counts=None) -> dict:
        """warp_specialized_matmul_kernel's arguments: the plan's, with the call's bias,
        counters, scalars and A's, B's, C's and (prefetched) the bias's host descriptors."""
        return warp_specialized_arguments(
            descriptors, sizes=self.sizes, config=self.config, variant=self.warp_specialized_variant,
            num_shards=self.queue.num_shards, checked=self.checked, a_row_major=self.a_row_major,
            b_row_major=self.b_row_major, counters=counters, live_budget=self.live_budget,
            unit_counts=unit_counts, bias=bias, bias_strides=self.strides[3], activation=self.activation,
            alpha=alpha, beta=beta)

    @property
    def warp_specialized_variant(self) -> WarpSpecializedVariant:
        config = self.config
        variant = WARP_SPECIALIZED_TILES[(config.block_m, config.block_n, config.block_k)]
        return variant.prefetching(config.block_n) if self.prefetch_bias else variant

    def descriptor_layouts(self) -> tuple:
        """A's, B's and (under TMA_STORE) C's DescriptorLayout, as launched (None for C
        without a TMA store). The warp-specialized kernel stores C in narrower subtiles."""
        m, n, k, batches = self.sizes
        stride_a, stride_b, stride_c, _ = self.strides
        bm, bn, bk = self.config.block_m, self.config.block_n, self.config.block_k
        c_cols = self.warp_specialized_variant.epilogue_n if self.kernel is Kernel.WARP_SPECIALIZED else bn
        return (descriptor_layout((batches, m, k), stride_a, bm, bk),
                descriptor_layout((batches, k, n), stride_b, bk, bn),
                descriptor_layout((batches, m, n), stride_c, bm, c_cols) if self.tma_store else None)

    def bias_descriptor_layout(self) -> "DescriptorLayout | None":
        """The prefetched bias's: (1, M, N) with C's subtile box (it lands in C's buffers)."""
        if not self.prefetch_bias:
            return None
        m, n = self.sizes[:2]
        return descriptor_layout((1, m, n), (0, self.strides[3][0], 1), self.config.block_m,
                                 self.warp_specialized_variant.epilogue_n)

    @property
    def launch_options(self) -> dict:
        if self.kernel is Kernel.WARP_SPECIALIZED:
            return self.warp_specialized_variant.launch_options
        return dict(num_warps=self.config.num_warps, num_stages=self.config.num_stages)


@dataclasses.dataclass(frozen=True)
class DescriptorLayout:
    """What a host-built tensor descriptor of a (batch, rows, cols) operand says, as the
    kernel's _program_descriptor makes it in the programs: a box of (1 batch, rows, columns),
    so one descriptor serves every tile of every batch; a column-major operand described
    as its transpose."""
    shape: tuple  # (batches, rows, columns) as described
    strides: tuple  # (batch, row, 1)
    box: tuple  # (1, box rows, box columns)


def descriptor_layout(shape: tuple, stride: tuple, box_rows: int, box_cols: int) -> DescriptorLayout:
    batches, rows, cols = shape
    batch_stride, row_stride, col_stride = stride
    if col_stride != 1:
        rows, cols, row_stride, box_rows, box_cols = cols, rows, col_stride, box_cols, box_rows
    if batches == 1:  # unused; must be a 16-byte multiple, as in the kernel
        batch_stride = row_stride * rows
    return DescriptorLayout((batches, rows, cols), (batch_stride, row_stride, 1), (1, box_rows, box_cols))


def _epilogue_constants(epilogue: str) -> dict:
    activation, gated = split_epilogue(epilogue)
    return dict(ACTIVATION=activation, GATE=gated)


def tf32_enabled() -> bool:
    """Whether torch.mm may use TF32 for fp32 inputs; reads the new API, then the legacy one."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    return torch.backends.cuda.matmul.allow_tf32


def plan(a: Operand, b: Operand, bias: Operand | None, *, batched: bool, dtype: torch.dtype,
         device: torch.device, alpha_zero: bool, beta_zero: bool, tf32: bool,
         knobs: Knobs = _DEFAULT_KNOBS, traced: bool = False, checked: bool = False,
         batch_invariant: bool = False, max_programs: int | None = None,
         live_budget: torch.Tensor | None = None, activation: str = "none",
         hint: Callable = lambda size: size, dynamic: bool = False,
         fits_int32: Callable[[object], bool] | None = None, out: Operand | None = None,
         graphed: bool = False, warp_specialize: bool = False) -> LaunchPlan:
    """The launch of alpha * a @ b + beta * bias for (B, M, K) and (B, K, N) operands (a 2-D
    GEMM is one batch), bias None or broadcastable to (M, N).

    traced: the operands have no data yet (FakeTensors, or Inductor's IR): no copies that
    only pay on real data, and descriptors made by the programs, unless `graphed` (a CUDA
    graph replays the traced launch, so descriptors built on the host cost no time per
    run, and the programs save making them). Inductor passes `hint` (the
    sizes it plans for), `dynamic` (some size is symbolic: one program per SM, no K split,
    no swap) and `fits_int32` (whether an offset is known to stay below 2**31 - 1). `out`:
    the (B, M, N) output's layout when it is not a fresh tensor's. batch_invariant: the K
    chunks ignore M and the batch count, so each output element is summed in the
    same order whatever rows share the launch (a tile's rows are computed alike, masked or
    not; neither the tile's size nor its K step changes a chunk's sums); M picks only the
    tile and whether the chunks run as split-K units, which add the same values in the
    same order. warp_specialize: run the warp-specialized kernel where it can take the
    launch (warp_specialized_eligible), the Triton kernel elsewhere. max_programs: an
    SM budget (budget.py) capping the grid; the tile choice ignores it, so results do not
    depend on it. live_budget: a LiveBudget's device word, which the programs read between
    units (they leave at or above it): the launch then steals work whatever its size, since
    a static schedule cannot lose programs. activation: applied to alpha * a @ b + beta *
    bias by the epilogue, so act(x @ w + b) needs no pass of its own; or "gate_<act>":
    act(bias) * alpha * a @ b, a gated linear unit (activations.EPILOGUES).
    """
    if activation not in EPILOGUES:
        raise ValueError(f"activation must be one of {EPILOGUES}, got {activation!r}")
    if split_epilogue(activation)[1] and (bias is None or beta_zero):
        raise ValueError(f"epilogue {activation!r} multiplies by a gate: pass it as the bias, with beta 1")
    batches, m, k = a.shape
    n = b.shape[2]
    out_shape = (batches, m, n) if batched else (m, n)
    compute_dtype = torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
    keep_bias = bias is not None and not beta_zero
    if hint(batches) * hint(m) * hint(n) == 0:
        return LaunchPlan(Outcome.EMPTY, out_shape, compute_dtype, keep_bias, activation=activation)
    if hint(k) == 0 or alpha_zero:  # as BLAS and torch.addmm: A, B and alpha not read
        return LaunchPlan(Outcome.FILL, out_shape, compute_dtype, keep_bias, activation=activation)

    # Hopper's wgmma reads TF32 operands from shared memory only K-major; Triton otherwise
    # copies each tile through registers and cannot overlap the MMAs (NOTES.md step 11):
    # give A K-contiguous rows and B K-contiguous columns.
    tf32_k_major = dtype == torch.float32 and tf32 and device.type == "cuda"
    align = (knobs.use_tma is None and not traced and devices.has_tma(device)
             and _aligning_pays(a, b, TF32_COPY_MIN_FLOPS_PER_BYTE if tf32_k_major
                                else ALIGN_MIN_FLOPS_PER_BYTE))
    copy_a = _operand_copy(a, align, k_dim=2 if tf32_k_major else None)
    copy_b = _operand_copy(b, align, k_dim=1 if tf32_k_major else None)
    a, b = a.copied(copy_a), b.copied(copy_b)
    c = out or Operand((batches, m, n), (m * n, n, 1), a.element_size, True)
    bias_strides = _broadcast_strides(bias, (m, n)) if keep_bias else (0, 0)

    if knobs.config is not None:
        config = knobs.config
    elif batch_invariant:
        config = select_invariant_config(hint(m), hint(n), hint(k), hint(batches), dtype, device,
                                         allow_split_k=not dynamic, allow_swap_ab=not dynamic,
                                         warp_specialized=warp_specialize and not traced and devices.has_wgmma(device))
    else:
        config = select_config(hint(m), hint(n), hint(k), hint(batches), dtype, device,
                               allow_split_k=not dynamic, allow_swap_ab=not dynamic)
    if config.k_chunks > 1 and config.split_k not in (1, config.k_chunks):
        raise ValueError(f"a config with k_chunks={config.k_chunks} splits K into 1 or {config.k_chunks} "
                         f"units (its chunks), not {config.split_k}")
    swap_ab = config.swap_ab
    if swap_ab:  # C^T = B^T @ A^T: the same kernel on transposed views
        a, b, c = b.transposed(), a.transposed(), c.transposed()
        bias_strides = bias_strides[::-1]
        m, n = n, m

    num_shards = devices.default_num_shards(device) if knobs.num_shards is None else knobs.num_shards
    tiles = num_tiles(m, n, batches, config)
    # A split tail's whole tiles fill the device's whole waves: its SM count, not the grid,
    # so that an SM budget does not change which tiles are split (nor a bit of C).
    units = devices.num_compute_units(device)
    whole_tiles = tiles // units * units if config.split_tail else 0
    queue = WorkQueue(num_shards, tiles, config.split_k, config.block_m // config.sum_rows,
                      work_stealing=True, whole_tiles=whole_tiles)  # the schedule below may make it static
    product_units = queue.product_units
    if knobs.num_programs is not None:
        grid = knobs.num_programs
    elif dynamic:
        grid = units  # programs that find no unit exit at once
    else:
        grid = min(max_programs or units, product_units)
    if num_shards < 1 or grid < 1:
        raise ValueError(f"need num_shards >= 1 and num_programs >= 1, got {num_shards}, {grid}")
    schedule = knobs.schedule
    if live_budget is not None and schedule is Schedule.STATIC:
        live_budget = None  # a forced static schedule (tests): its units are the programs'
    if live_budget is None and not dynamic and product_units <= grid and (
            config.split_k == 1 or config.split_k * config.partial_bytes <= LAST_SLICE_SUM_MAX_BYTES):
        # One wave: each program has at most one unit, and one whose SM is held by other
        # work runs it as soon as a thief could have. Stealing would buy nothing and its
        # claims cost time (NOTES.md step 13). With split-K, unless the tile's last slice
        # would read too many partials alone.
        schedule = Schedule.STATIC
    queue = dataclasses.replace(queue, work_stealing=schedule is Schedule.WORK_STEALING)

    describable = _describable(a) and _describable(b)
    use_tma = knobs.use_tma
    if use_tma is None:
        use_tma = devices.has_tma(device) and describable
    elif use_tma and not describable:
        raise ValueError("use_tma=True needs 16-byte aligned operands with a unit stride")
    tma_store = use_tma and c.stride[2] == 1 and _describable(c)
    host_descriptors = knobs.host_descriptors
    if host_descriptors is None:
        host_descriptors = not traced or (graphed and not dynamic)

    offsets = [_max_offset(t.shape, t.stride) for t in (a, b, c)]
    if keep_bias:
        offsets.append(_max_offset((m, n), bias_strides))
    fits = fits_int32 or (lambda offset: offset < 2**31 - 1)
    int64_index = not all(fits(offset) for offset in offsets)
    host_descriptors = use_tma and host_descriptors
    kernel = Kernel.TRITON
    if warp_specialize and warp_specialized_eligible(
            device, dtype, config, queue, traced=traced, host_descriptors=host_descriptors,
            tma_store=tma_store, int64_index=int64_index):
        kernel = Kernel.WARP_SPECIALIZED
    prefetch_bias = kernel is Kernel.WARP_SPECIALIZED and keep_bias and _prefetchable(bias, bias_strides, c)
    return LaunchPlan(
        Outcome.LAUNCH, out_shape, compute_dtype, keep_bias,
        copy_a=copy_a, copy_b=copy_b, swap_ab=swap_ab, config=config, queue=queue, grid=grid,
        use_tma=use_tma, host_descriptors=host_descriptors,
        a_row_major=use_tma and a.stride[2] == 1, b_row_major=use_tma and b.stride[2] == 1,
        tma_store=tma_store,
        int64_index=int64_index,
        input_precision="tf32" if dtype == torch.float32 and tf32 else "ieee",
        sizes=(m, n, k, batches), strides=(a.stride, b.stride, c.stride, bias_strides),
        partials_numel=queue.split_tiles * config.split_k * config.block_m * config.block_n,
        max_spins=scheduler.MAX_SPINS,
        checked=checked,
        live_budget=live_budget,
        activation=activation,
        kernel=kernel,
        prefetch_bias=prefetch_bias,
    )


def warp_specialized_arguments(descriptors: tuple, *, sizes: tuple, config: TileConfig,
                               variant: WarpSpecializedVariant, num_shards: int, checked: bool,
                               a_row_major: bool, b_row_major: bool, counters, live_budget, unit_counts,
                               bias=None, bias_strides: tuple = (0, 0), activation: str = "none",
                               alpha: float = 1.0, beta: float = 0.0, offs=None, groups_block: int = 1) -> dict:
    """warp_specialized_matmul_kernel's arguments by name, in its order, for a dense launch
    (LaunchPlan) or a grouped one along K (grouped.py: offs, C's batches its groups).
    descriptors: A's, B's, C's and the prefetched bias's (or None)."""
    m, n, k, batches = sizes
    a_desc, b_desc, c_desc, bias_desc = descriptors
    return dict(
        a_desc=a_desc, b_desc=b_desc, c_desc=c_desc, bias_desc=bias_desc, bias_ptr=bias, counters_ptr=counters,
        budget_ptr=live_budget, unit_counts_ptr=unit_counts, offs_ptr=offs, M=m, N=n, K=k, num_batches=batches,
        stride_bias_m=bias_strides[0], stride_bias_n=bias_strides[1], alpha=alpha, beta=beta,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        NUM_SHARDS=num_shards, COUNTER_STRIDE=devices.COUNTER_STRIDE,
        CHECKED=checked, A_ROW_MAJOR=a_row_major, B_ROW_MAJOR=b_row_major,
        **_epilogue_constants(activation), **variant.kernel_constants(), GROUPS_BLOCK=groups_block,
        K_CHUNKS=config.k_chunks,
    )


def warp_specialized_eligible(device: torch.device, dtype: torch.dtype, config: TileConfig, queue: WorkQueue,
                              *, traced: bool, host_descriptors: bool, tma_store: bool,
                              int64_index: bool) -> bool:
    """Whether the warp-specialized kernel can take a launch the Triton kernel would run so,
    with the same bits: Hopper's wgmma (sm_90), 16-bit operands, a tile it runs
    (config.WARP_SPECIALIZED_TILES) with no K split and no swap, K chunks only where its MMA
    warps hold two accumulators (128x128), work stealing (it has no static schedule), and
    every operand moved by a host-built descriptor (it makes none in its programs, so no
    traced launch) with C stored through one; its bias offsets are int32."""
    variant = WARP_SPECIALIZED_TILES.get((config.block_m, config.block_n, config.block_k))
    return (variant is not None and not traced and host_descriptors and tma_store and not int64_index
            and dtype in (torch.bfloat16, torch.float16) and devices.has_wgmma(device)
            and config.split_k == 1 and not config.swap_ab and queue.work_stealing
            and (config.k_chunks == 1 or fits_chunked(config, variant.num_warps)))


def _prefetchable(bias: Operand, strides: tuple, c: Operand) -> bool:
    """Whether a tensor descriptor can read the bias as an (M, N) operand in C's layout: a
    16-byte aligned base, unit column stride, 16-byte aligned rows that differ (a row
    vector broadcast down the columns is a few KB, read from L2 as it is), C's dtype."""
    row_stride, col_stride = strides
    return (bias.aligned is True and bias.element_size == c.element_size and col_stride == 1
            and row_stride != 0 and (row_stride * bias.element_size) % 16 == 0)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _aligning_pays(a: Operand, b: Operand, min_flops_per_byte: int) -> bool:
    batches, m, k = a.shape
    n = b.shape[2]
    copied_bytes = 2 * a.element_size * batches * (m * k + k * n)
    return 2 * batches * m * n * k >= min_flops_per_byte * copied_bytes


def _describable(t: Operand) -> bool:
    """Whether a tensor descriptor can move the operand: one unit stride, the other stride,
    the batch stride (when there are batches) and the base all 16-byte aligned."""
    _, rows, cols = t.stride
    other = rows if cols == 1 else cols if rows == 1 else None
    if other is None or not t.aligned:
        return False
    aligned = [other * t.element_size]
    if t.shape[0] > 1:
        aligned.append(t.stride[0] * t.element_size)
    return all(x % 16 == 0 for x in aligned)


def _operand_copy(t: Operand, align: bool, k_dim: int | None) -> OperandCopy:
    """As it is; when aligning pays, copied into padded rows or columns if descriptors
    cannot read it as it is, or if `k_dim` is given and K is not its contiguous dimension;
    copied row-major if it has no unit stride."""
    if align and ((k_dim is not None and t.stride[k_dim] != 1) or not _describable(t)):
        return OperandCopy.COLUMNS if k_dim == 1 else OperandCopy.ROWS
    if t.stride[2] == 1 or t.stride[1] == 1:
        return OperandCopy.NONE
    return OperandCopy.CONTIGUOUS


def _broadcast_strides(bias: Operand, out: tuple) -> tuple:
    """The (row, column) strides of bias.expand(M, N): a size-1 or missing dimension repeats."""
    shape, stride = bias.shape, bias.stride
    result = []
    for i, size in enumerate(out):
        dim = len(shape) - len(out) + i
        result.append(stride[dim] if dim >= 0 and shape[dim] != 1 else 0)
    return tuple(result)


def _max_offset(shape, stride):
    return sum((size - 1) * abs(s) for size, s in zip(shape, stride))


def shard_setting() -> str | None:
    """$TRITONBLAS_OPS_NUM_SHARDS as set now (part of a cached plan's key)."""
    return os.environ.get(devices.SHARDS_ENV)

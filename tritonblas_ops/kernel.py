"""The work-stealing persistent GEMM: C[b] = alpha * A[b] @ B[b] + beta * bias.

One program per SM/CU. The work units (every batch's output tiles, in one queue, and with
split-K each tile's K slices) are numbered 0..U-1 in GROUP_M-swizzled tile order and split
into NUM_SHARDS contiguous shards, each with an atomic counter. Program p starts on shard
p % NUM_SHARDS (on AMD that is its XCD, so its tiles stay in that XCD's L2), claims units
there until the shard is dry, then steals from the other shards in order. Every unit is
computed exactly once, by whichever program claims it, for any grid size and however many
programs actually run (other kernels may hold SMs). A launch with no more units than
programs takes the static schedule instead: with one unit each there is nothing to steal.

Each unit runs its K range in one program, in a fixed order. With split-K each slice stores
an fp32 partial; under work stealing the partials are summed by sum units (a few rows of a
tile each) claimed after every product unit, under the static schedule by the tile's last
slice to arrive, always in slice order. Results are bitwise reproducible whatever the
schedule.

Reads top to bottom: work-unit helpers, the tile body (descriptors, product, split-K sum,
epilogue), the persistent loop, the launcher, and the cached eager launch.
"""

import contextlib
import dataclasses
import enum
import functools
import os
import threading

import torch
import triton
import triton.language as tl
from triton import knobs
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tritonblas_ops import device as devices
from tritonblas_ops import relayout
from tritonblas_ops.config import TileConfig, num_tiles, select_config
from tritonblas_ops.counters import discard as discard_counters
from tritonblas_ops.counters import zeroed as zeroed_counters


class Schedule(enum.Enum):
    WORK_STEALING = "work_stealing"  # tiles claimed from sharded atomic counters
    STATIC = "static"  # program p takes tiles p, p + grid, ...: the baseline we beat


# ---------------------------------------------------------------------------------------
# Work-unit helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of a tile number, GROUP_M rows swizzled together
    so that programs running at the same time share B's columns in L2."""
    tiles_per_batch = tiles_m * tiles_n
    batch = tile // tiles_per_batch
    tile_in_batch = tile % tiles_per_batch
    tiles_per_group = GROUP_M * tiles_n
    first_m = (tile_in_batch // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile_in_batch % tiles_per_group) % group_rows
    tile_n = (tile_in_batch % tiles_per_group) // group_rows
    return batch, tile_m, tile_n


@triton.jit
def _shard_begin(shard, num_units, NUM_SHARDS: tl.constexpr):
    """First work unit of a shard: shards are contiguous, their sizes differ by at most one."""
    return (shard.to(tl.int64) * num_units // NUM_SHARDS).to(tl.int32)


@triton.jit
def _claim_unit(counters_ptr, home_shard, dry_shards, num_units, num_programs,
                NUM_SHARDS: tl.constexpr, COUNTER_STRIDE: tl.constexpr):
    """The next work unit for this program, or -1 once every shard is dry.

    `dry_shards` counts the shards, from the home shard on, that this program has found
    empty; it is carried between calls so no program asks an empty shard twice, and every
    program asks every shard once after it ran dry. So the last claim a shard ever gets
    returns its size + num_programs - 1, and its program resets the counter for the next
    launch (counters.py: no launch zeroes its buffer).
    """
    unit = -1
    while (unit < 0) & (dry_shards < NUM_SHARDS):
        shard = (home_shard + dry_shards) % NUM_SHARDS
        begin = _shard_begin(shard, num_units, NUM_SHARDS)
        size = _shard_begin(shard + 1, num_units, NUM_SHARDS) - begin
        # Relaxed is enough: the counter only hands out indices, it guards no data.
        claimed = tl.atomic_add(counters_ptr + shard * COUNTER_STRIDE, 1, sem="relaxed")
        if claimed < size:
            unit = begin + claimed
        else:
            if claimed == size + num_programs - 1:
                tl.store(counters_ptr + shard * COUNTER_STRIDE, 0)
            dry_shards += 1
    return unit, dry_shards


# ---------------------------------------------------------------------------------------
# The tile body: the product over a K range, split-K partial sums, the epilogue
# ---------------------------------------------------------------------------------------


@triton.jit
def _program_descriptor(ptr, num_batches, rows, cols, stride_batch, stride_row, stride_col,
                        BOX_ROWS: tl.constexpr, BOX_COLS: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """A (batch, rows, cols) operand's tensor descriptor, made by a program when the host
    built none (traced launches), as _descriptor builds it on the host: a box of (1 batch,
    rows, columns), so one descriptor serves every tile of every batch; a column-major
    operand is described as its transpose (and transposed back in registers)."""
    if ROW_MAJOR:
        if num_batches == 1:  # unused, but every stride must be a 16-byte multiple
            stride_batch = stride_row * rows
        desc = tl.make_tensor_descriptor(ptr, [num_batches, rows, cols], [stride_batch, stride_row, 1],
                                         [1, BOX_ROWS, BOX_COLS])
    else:
        if num_batches == 1:
            stride_batch = stride_col * cols
        desc = tl.make_tensor_descriptor(ptr, [num_batches, cols, rows], [stride_batch, stride_col, 1],
                                         [1, BOX_COLS, BOX_ROWS])
    return desc


@triton.jit
def _tile_product(
    a_ptr, b_ptr, a_desc, b_desc, batch, tile_m, tile_n, k_begin, k_end,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
):
    """One output tile's fp32 product over K in [k_begin, k_end), in a fixed order. Edges are
    exact: rows and columns past M, N, k_end are read as zeros (no index wrapping).

    USE_TMA: operands move through the program's tensor descriptors (Hopper's copy engine),
    which clip the edges in hardware; K slices end on multiples of BLOCK_K, so only the last
    one meets the edge at K. Otherwise through masked pointer loads, for any strides.
    """
    m0 = tile_m * BLOCK_M
    n0 = tile_n * BLOCK_N
    if not USE_TMA:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        if INT64_INDEX:  # some element offset reaches 2**31: do the address math in int64
            batch = batch.to(tl.int64)
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
            offs_k = offs_k.to(tl.int64)
        in_m = offs_m < M
        in_n = offs_n < N
        a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if USE_TMA:
            if A_ROW_MAJOR:
                a = a_desc.load([batch, m0, k0]).reshape(BLOCK_M, BLOCK_K)
            else:
                a = a_desc.load([batch, k0, m0]).reshape(BLOCK_K, BLOCK_M).T
            if B_ROW_MAJOR:
                b = b_desc.load([batch, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                b = b_desc.load([batch, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            in_k = offs_k < k_end
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            offs_k += BLOCK_K
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _store_partial(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K: store this slice's fp32 partial and count its arrival. Returns how many of
    the tile's slices had arrived before this one."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offs, acc)
    # Every thread's part of the partial is written before one thread counts the arrival;
    # the arrival releases the partials, and whoever sums them acquires them first.
    tl.debug_barrier()
    return tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")


@triton.jit
def _slice_sum(partials_ptr, tile, row0, SPLIT_K: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [row0, row0 + ROWS) of a tile's split-K partials, summed in slice order: bitwise
    the same whoever sums them, in whatever row shares."""
    offs = (row0 + tl.arange(0, ROWS))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        # .cg: read from L2, where the other SMs' writes are, never from a stale L1.
        acc += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    return acc


@triton.jit
def _store_tile(
    acc, c_ptr, c_desc, bias_ptr, batch, m0, n0, M, N,
    stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
    alpha, beta,
    ROWS: tl.constexpr, COLS: tl.constexpr, INT64_INDEX: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """C[m0:m0 + ROWS, n0:n0 + COLS] = alpha * acc + beta * bias, rounded to C's dtype;
    nothing past M, N written (the program's C descriptor, whose box is the whole tile,
    clips the edges; masked stores otherwise)."""
    offs_m = m0 + tl.arange(0, ROWS)
    offs_n = n0 + tl.arange(0, COLS)
    if INT64_INDEX:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    in_m = offs_m < M
    in_n = offs_n < N
    acc = acc * alpha
    if bias_ptr is not None:
        bias_ptrs = bias_ptr + offs_m[:, None] * stride_bias_m + offs_n[None, :] * stride_bias_n
        bias = tl.load(bias_ptrs, mask=in_m[:, None] & in_n[None, :], other=0.0)
        acc += beta * bias.to(tl.float32)
    c = acc.to(c_ptr.dtype.element_ty)
    if TMA_STORE:  # descriptor coordinates stay int32; the descriptor addresses in 64 bits
        c_desc.store([batch, m0, n0], c.reshape(1, ROWS, COLS))
    else:
        if INT64_INDEX:
            batch = batch.to(tl.int64)
        c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, c, mask=in_m[:, None] & in_n[None, :])


# ---------------------------------------------------------------------------------------
# The persistent loop
# ---------------------------------------------------------------------------------------


@triton.jit
def ws_matmul_kernel(
    a_ptr,  # (B, M, K), any strides
    b_ptr,  # (B, K, N), any strides
    c_ptr,  # (B, M, N), written
    bias_ptr,  # (M, N) view (broadcast strides may be 0), or None
    counters_ptr,  # int32 (counter_elements(...),), zero at launch and left at zero
    partials_ptr,  # fp32 (tiles * SPLIT_K * BLOCK_M * BLOCK_N,) workspace, or None (SPLIT_K 1)
    tile_counts_ptr,  # int32 (tiles * SPLIT_K,) zeroed, or None: +1 per work unit done (tests)
    # Under USE_TMA, A's and B's tensor descriptors built on the host (eager launches), or
    # None: each program makes them (~1 us each on its critical path; traced launches).
    a_desc, b_desc,
    c_desc,  # C's likewise, under TMA_STORE
    M, N, K, num_batches,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_bias_m, stride_bias_n,
    alpha, beta,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, SUM_ROWS: tl.constexpr,
    NUM_SHARDS: tl.constexpr, COUNTER_STRIDE: tl.constexpr,
    WORK_STEALING: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Work units: each tile's K slices, numbered next to each other (claimed close in time).
    num_units = tiles_m * tiles_n * num_batches * SPLIT_K
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    # Split-K: the sums' claim counter on a line of its own, then an arrival count per tile.
    sums_counter_ptr = counters_ptr + NUM_SHARDS * COUNTER_STRIDE
    arrivals_ptr = sums_counter_ptr + COUNTER_STRIDE

    if USE_TMA:
        if a_desc is None:
            a_desc = _program_descriptor(a_ptr, num_batches, M, K, stride_ab, stride_am, stride_ak,
                                         BLOCK_M, BLOCK_K, A_ROW_MAJOR)
            b_desc = _program_descriptor(b_ptr, num_batches, K, N, stride_bb, stride_bk, stride_bn,
                                         BLOCK_K, BLOCK_N, B_ROW_MAJOR)
    if TMA_STORE:  # row-major C
        if c_desc is None:
            c_desc = _program_descriptor(c_ptr, num_batches, M, N, stride_cb, stride_cm, stride_cn,
                                         BLOCK_M, BLOCK_N, True)

    home_shard = pid % NUM_SHARDS
    dry_shards = 0
    if WORK_STEALING:
        unit, dry_shards = _claim_unit(counters_ptr, home_shard, dry_shards, num_units,
                                       num_programs, NUM_SHARDS, COUNTER_STRIDE)
    else:
        unit = tl.where(pid < num_units, pid, -1)

    while unit >= 0:
        tile = unit // SPLIT_K
        split = unit % SPLIT_K
        batch, tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        k_begin = split * k_per_split
        k_end = tl.minimum(K, k_begin + k_per_split)
        acc = _tile_product(
            a_ptr, b_ptr, a_desc, b_desc, batch, tile_m, tile_n, k_begin, k_end, M, N, K,
            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INT64_INDEX,
            USE_TMA, A_ROW_MAJOR, B_ROW_MAJOR,
        )
        # The next unit is claimed before this one's epilogue, which hides the atomic's
        # round trip (~0.5 us) and holds the claim no longer than the epilogue lasts.
        if WORK_STEALING:
            next_unit, dry_shards = _claim_unit(counters_ptr, home_shard, dry_shards, num_units,
                                                num_programs, NUM_SHARDS, COUNTER_STRIDE)
        else:
            next_unit = unit + num_programs
            next_unit = tl.where(next_unit < num_units, next_unit, -1)
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        if SPLIT_K == 1:
            tile_done = True
        elif WORK_STEALING:
            _store_partial(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
            tile_done = False  # sum units add the partials up (after this loop)
        else:
            arrived = _store_partial(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K,
                                     BLOCK_M, BLOCK_N)
            tile_done = arrived == SPLIT_K - 1
            if tile_done:  # static: the tile's last slice to arrive sums it by itself
                acc = _slice_sum(partials_ptr, tile, 0, SPLIT_K, BLOCK_M, BLOCK_M, BLOCK_N)
                tl.store(arrivals_ptr + tile, 0)  # the counter is clean for the next launch
        if tile_done:
            _store_tile(
                acc, c_ptr, c_desc, bias_ptr, batch, m0, n0, M, N,
                stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
                alpha, beta, BLOCK_M, BLOCK_N, INT64_INDEX, TMA_STORE,
            )
        if tile_counts_ptr is not None:
            tl.atomic_add(tile_counts_ptr + unit, 1, sem="relaxed")
        unit = next_unit

    if WORK_STEALING and SPLIT_K > 1:
        # Work stealing spreads each tile's slice sum over all programs: SUM_ROWS rows of a
        # tile per sum unit, claimed from a counter of their own once every product unit has
        # been claimed. So a sum waits only for slices that running programs are computing,
        # however few programs run (a static schedule could wait on one not yet started).
        parts_per_tile = BLOCK_M // SUM_ROWS
        num_sums = tiles_m * tiles_n * num_batches * parts_per_tile
        sums_dry = 0
        part, sums_dry = _claim_unit(sums_counter_ptr, 0, sums_dry, num_sums, num_programs, 1,
                                     COUNTER_STRIDE)
        while part >= 0:
            tile = part // parts_per_tile
            row0 = (part % parts_per_tile) * SUM_ROWS
            arrived = tl.atomic_add(arrivals_ptr + tile, 0, sem="acquire")
            while arrived < SPLIT_K:
                arrived = tl.atomic_add(arrivals_ptr + tile, 0, sem="acquire")
            acc = _slice_sum(partials_ptr, tile, row0, SPLIT_K, SUM_ROWS, BLOCK_M, BLOCK_N)
            next_part, sums_dry = _claim_unit(sums_counter_ptr, 0, sums_dry, num_sums, num_programs,
                                              1, COUNTER_STRIDE)
            batch, tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
            # Pointer stores: the C descriptor's box is a whole tile.
            _store_tile(
                acc, c_ptr, c_desc, bias_ptr, batch, tile_m * BLOCK_M + row0, tile_n * BLOCK_N, M, N,
                stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
                alpha, beta, SUM_ROWS, BLOCK_N, INT64_INDEX, False,
            )
            # The tile's last sum to finish leaves its arrival counter clean for the next launch.
            if tl.atomic_add(arrivals_ptr + tile, 1, sem="relaxed") == SPLIT_K + parts_per_tile - 1:
                tl.store(arrivals_ptr + tile, 0)
            part = next_part


# ---------------------------------------------------------------------------------------
# The host launcher
# ---------------------------------------------------------------------------------------


# The interpreter keeps the grid position in module state, and the patch of JITFunction
# below is process-wide: one interpreted launch at a time, whichever thread asks.
_INTERPRETER_LOCK = threading.Lock()


class _InterpretedKernel:
    """The same kernel run by Triton's interpreter, for CPU tensors.

    Without TRITON_INTERPRET=1 the helpers it calls (ours and tl.cdiv's) are compiled-mode
    JITFunctions, whose __call__ only raises; while the copy runs, they are interpreted too.
    """

    def __init__(self, jit_function):
        from triton.runtime.interpreter import InterpretedFunction

        self._kernel = InterpretedFunction(jit_function.fn)
        self._helpers = {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction

            def interpreted_call(jit_fn, *call_args, **call_kwargs):
                # Keyed by id: hashing a JITFunction would parse its source.
                if id(jit_fn) not in self._helpers:
                    self._helpers[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
                # rewrite() rather than __call__: __call__ patches triton.language and never
                # restores it, which breaks every later compile in the process. The launch's
                # own patch (restored when it ends) covers tl and tl.core (see _TL_CORE).
                return self._helpers[id(jit_fn)].rewrite()(*call_args, **call_kwargs)

            with _INTERPRETER_LOCK:
                compiled_call = JITFunction.__call__
                JITFunction.__call__ = interpreted_call
                try:
                    self._kernel[grid](*args, **kwargs)
                finally:
                    JITFunction.__call__ = compiled_call

        return run


# The interpreter patches the triton.language modules it finds among the kernel's globals
# for the length of a launch; Triton's own helpers (tl.cdiv, ...) are written against
# tl.core, so it must be one of them.
_TL_CORE = tl.core

_interpreted_kernel = functools.cache(lambda: _InterpretedKernel(ws_matmul_kernel))


def tf32_enabled() -> bool:
    """Whether torch.mm may use TF32 for fp32 inputs; reads the new API, then the legacy one."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    return torch.backends.cuda.matmul.allow_tf32


def _max_offset(t: torch.Tensor) -> int:
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def _tma_compatible(t: torch.Tensor, traced: bool) -> bool:
    """A (B, R, C) operand a tensor descriptor can move: one unit stride, the other stride,
    the batch stride (when there are batches) and the base all 16-byte aligned."""
    rows, cols = t.stride(1), t.stride(2)
    other = rows if cols == 1 else cols if rows == 1 else None
    if other is None:
        return False
    # While tracing there is no data pointer: the allocator aligns storages to far more
    # than 16 bytes, so the view's offset into its storage decides.
    base = t.storage_offset() * t.element_size() if traced else t.data_ptr()
    aligned = [base, other * t.element_size()]
    if t.shape[0] > 1:
        aligned.append(t.stride(0) * t.element_size())
    return all(x % 16 == 0 for x in aligned)


def _host_descriptors(a, b, c, config: TileConfig) -> tuple:
    """A's, B's and (unless c is None) C's tensor descriptors, as _program_descriptor makes
    them in the kernel: (batch, rows, columns) with one-batch boxes, a column-major operand
    described as its transpose."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return (_descriptor(a, bm, bk), _descriptor(b, bk, bn),
            _descriptor(c, bm, bn) if c is not None else None)


def _descriptor(t: torch.Tensor, box_rows: int, box_cols: int) -> TensorDescriptor:
    batches, rows, cols = t.shape
    batch_stride, row_stride, col_stride = t.stride()
    if col_stride != 1:
        rows, cols, row_stride, box_rows, box_cols = cols, rows, col_stride, box_cols, box_rows
    if batches == 1:  # unused; must be a 16-byte multiple, as in _program_descriptor
        batch_stride = row_stride * rows
    return TensorDescriptor(t, [batches, rows, cols], [batch_stride, row_stride, 1],
                            [1, box_rows, box_cols])


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory where programs write the tensor descriptors they create."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def counter_elements(num_shards: int, num_tiles: int, split_k: int) -> int:
    """int32 counters one launch uses, each zero at launch and left at zero by it: a claim
    counter per shard, each on its own COUNTER_STRIDE line, then for split-K the sum units'
    claim counter (a line of its own) and an arrival counter per tile."""
    if split_k == 1:
        return num_shards * devices.COUNTER_STRIDE
    return (num_shards + 1) * devices.COUNTER_STRIDE + num_tiles


def launch(
    a: torch.Tensor,  # (B, M, K)
    b: torch.Tensor,  # (B, K, N)
    c: torch.Tensor,  # (B, M, N), written
    bias: torch.Tensor | None,  # broadcastable to (M, N), or None
    alpha: float,
    beta: float,
    counters: torch.Tensor,  # int32, zero, at least counter_elements(...) long
    *,
    config: TileConfig,
    num_shards: int,
    num_programs: int,
    schedule: Schedule = Schedule.WORK_STEALING,
    use_tma: bool | None = None,
    tile_counts: torch.Tensor | None = None,
    host_descriptors: bool | None = None,
):
    """Launch the kernel on already checked, non-empty 3-D operands. Returns what the launch
    gave (eagerly on a GPU, Triton's compiled kernel) and the kernel's arguments by name.

    use_tma: None loads through tensor descriptors wherever the device and A's and B's
    layouts allow them; C is then stored through one too if its layout allows.
    host_descriptors: None builds the descriptors here for an eager launch and leaves them
    to the programs for a traced one (torch.compile: no data pointers yet).
    """
    batches, m, k = a.shape
    n = b.shape[2]
    if num_shards < 1 or num_programs < 1:
        raise ValueError(f"need num_shards >= 1 and num_programs >= 1, got {num_shards}, {num_programs}")
    tiles = num_tiles(m, n, batches, config)
    needed = counter_elements(num_shards, tiles, config.split_k)
    if counters.dtype != torch.int32 or counters.numel() < needed:
        raise ValueError(
            f"counter buffer must be int32 with >= {needed} elements for {num_shards} shards "
            f"and {tiles} tiles split {config.split_k} ways, got {counters.dtype} with {counters.numel()}"
        )
    if bias is not None:
        bias = bias.expand(m, n)
    operands = [t for t in (a, b, c, bias) if t is not None]
    fp32 = a.dtype == torch.float32
    traced = is_fake(a)
    tma_ok = _tma_compatible(a, traced) and _tma_compatible(b, traced)
    if use_tma is None:
        use_tma = devices.has_tma(a.device) and tma_ok
    elif use_tma and not tma_ok:
        raise ValueError("use_tma=True needs 16-byte aligned operands with a unit stride")
    tma_store = use_tma and c.stride(2) == 1 and _tma_compatible(c, traced)
    if host_descriptors is None:
        host_descriptors = not traced
    descriptors = (None, None, None)
    if use_tma and host_descriptors:
        descriptors = _host_descriptors(a, b, c if tma_store else None, config)
    if use_tma and a.device.type == "cuda":
        # For descriptors made by the programs. Triton's allocator is a context variable:
        # a traced kernel runs later, so every launch (eager ones too) sets it.
        triton.set_allocator(_descriptor_scratch)
    partials = None
    if config.split_k > 1:
        partials = torch.empty(tiles * config.split_k * config.block_m * config.block_n,
                               dtype=torch.float32, device=a.device)
    if a.device.type == "cpu":
        kernel = _interpreted_kernel()
    elif traced:
        kernel = wrap_triton(ws_matmul_kernel)  # traced: the kernel itself enters the graph
    else:
        kernel = ws_matmul_kernel  # eager: a direct launch (the traceable wrapper costs ~0.3 ms)
    args = kernel_arguments(
        a, b, c, bias, counters, partials, tile_counts, descriptors,
        sizes=(m, n, k, batches),
        strides=(a.stride(), b.stride(), c.stride(), bias.stride() if bias is not None else (0, 0)),
        alpha=alpha, beta=beta, config=config, num_shards=num_shards,
        work_stealing=schedule is Schedule.WORK_STEALING,
        tf32=fp32 and tf32_enabled(),
        int64_index=max(_max_offset(t) for t in operands) >= 2**31 - 1,
        use_tma=use_tma,
        a_row_major=use_tma and a.stride(2) == 1,
        b_row_major=use_tma and b.stride(2) == 1,
        tma_store=tma_store,
    )
    return kernel[(num_programs,)](**args, num_warps=config.num_warps, num_stages=config.num_stages), args


def kernel_arguments(a, b, c, bias, counters, partials, tile_counts, descriptors, *, sizes, strides, alpha,
                     beta, config: TileConfig, num_shards: int, work_stealing: bool,
                     tf32: bool, int64_index: bool, use_tma: bool,
                     a_row_major: bool, b_row_major: bool, tma_store: bool) -> dict:
    """ws_matmul_kernel's arguments by name, in its order, for the eager launch here and the
    launch that routing.py writes into Inductor's generated code (operands are IR nodes there).

    descriptors: A's, B's and C's host-built tensor descriptors, each or all None;
    sizes: (M, N, K, batches); strides: A's, B's and C's (batch, row, column) strides and the
    bias's (row, column) strides.
    """
    m, n, k, batches = sizes
    stride_a, stride_b, stride_c, stride_bias = strides
    a_desc, b_desc, c_desc = descriptors
    return dict(
        a_ptr=a, b_ptr=b, c_ptr=c, bias_ptr=bias, counters_ptr=counters, partials_ptr=partials,
        tile_counts_ptr=tile_counts, a_desc=a_desc, b_desc=b_desc, c_desc=c_desc,
        M=m, N=n, K=k, num_batches=batches,
        **dict(zip(("stride_ab", "stride_am", "stride_ak"), stride_a)),
        **dict(zip(("stride_bb", "stride_bk", "stride_bn"), stride_b)),
        **dict(zip(("stride_cb", "stride_cm", "stride_cn"), stride_c)),
        **dict(zip(("stride_bias_m", "stride_bias_n"), stride_bias)),
        alpha=alpha, beta=beta,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, SPLIT_K=config.split_k, SUM_ROWS=config.sum_rows,
        NUM_SHARDS=num_shards, COUNTER_STRIDE=devices.COUNTER_STRIDE,
        WORK_STEALING=work_stealing,
        INPUT_PRECISION="tf32" if tf32 else "ieee",
        INT64_INDEX=int64_index,
        USE_TMA=use_tma, A_ROW_MAJOR=a_row_major, B_ROW_MAJOR=b_row_major,
        TMA_STORE=tma_store,
    )


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
) -> torch.Tensor:
    """alpha * a @ b + beta * bias for 2-D (M, K) @ (K, N) or 3-D (B, M, K) @ (B, K, N).

    The plain Python entry point under the torch ops, with the knobs they keep at defaults:
    tile config, shard count, grid size, schedule and load path. Inputs must already be
    valid (the ops check them). An operand with no unit stride is copied to row-major
    first, and on a TMA GPU one whose rows are not 16-byte aligned (or, for TF32, whose K
    is not contiguous) is copied into aligned rows or columns when the GEMM is large
    enough to pay for it (_operand_fix). A config with swap_ab (the selector's choice for
    M <= 16) launches C^T = B^T @ A^T. With the default knobs on a GPU, repeated calls with
    one shape, layout and alignment reuse the first call's decisions and compiled kernel
    (_cached_launch).
    """
    alpha, beta = float(alpha), float(beta)  # one kernel signature, whatever the caller passed
    default_knobs = (config is None and num_shards is None and num_programs is None
                     and schedule is Schedule.WORK_STEALING and use_tma is None)
    if default_knobs and a.is_cuda and type(a) in _PLAIN and type(b) in _PLAIN and type(bias) in _PLAIN:
        return _cached_launch(a, b, bias, alpha, beta)
    return _ws_matmul(a, b, bias, alpha, beta, config=config, num_shards=num_shards,
                      num_programs=num_programs, schedule=schedule, use_tma=use_tma)


def _ws_matmul(a, b, bias, alpha, beta, *, config, num_shards, num_programs, schedule, use_tma,
               plan_key=None):
    """ws_matmul, every decision made from the shapes; with `plan_key`, what it decided is
    kept under the key for _cached_launch."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot multiplies raw bits. bf16 products are exact in
        # fp32, so fp32 operands give what the GPU's bf16 dot would.
        bias32 = bias.float() if bias is not None else None
        return _ws_matmul(a.float(), b.float(), bias32, alpha, beta, config=config,
                          num_shards=num_shards, num_programs=num_programs,
                          schedule=schedule, use_tma=use_tma).to(torch.bfloat16)
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    batches, m, k = a3.shape
    n = b3.shape[2]
    # Hopper's wgmma reads TF32 operands from shared memory only K-major; Triton otherwise
    # copies each tile through registers and cannot overlap the MMAs (~70 TFLOP/s on the
    # H200, NOTES.md step 11): give A K-contiguous rows and B K-contiguous columns.
    tf32_k_major = a.dtype == torch.float32 and tf32_enabled()
    align = use_tma is None and devices.has_tma(a.device) and _aligning_pays(
        a3, b3, TF32_COPY_MIN_FLOPS_PER_BYTE if tf32_k_major else ALIGN_MIN_FLOPS_PER_BYTE)
    fix_a = _operand_fix(a3, align, k_dim=2 if tf32_k_major else None)
    fix_b = _operand_fix(b3, align, k_dim=1 if tf32_k_major else None)
    a3, b3 = _fixed(a3, fix_a), _fixed(b3, fix_b)
    c = torch.empty((batches, m, n) if batched else (m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if bias is not None and beta == 0:
        bias = None  # torch.addmm ignores bias when beta == 0, NaN and Inf included
    if k == 0 or alpha == 0:
        # As BLAS (and torch.addmm): no product to scale, so A, B and alpha are not read.
        c.copy_(beta * bias.expand(c.shape[-2:]) if bias is not None else torch.zeros_like(c))
        return c
    config = config or select_config(m, n, k, batches, a.dtype, a.device)
    c3 = c if batched else c.unsqueeze(0)
    if config.swap_ab:  # C^T = B^T @ A^T: the same kernel on transposed views
        a3, b3, c3 = b3.mT, a3.mT, c3.mT
        bias = bias.expand(m, n).mT if bias is not None else None
        m, n = n, m
    if num_shards is None:
        num_shards = devices.default_num_shards(a.device)
    tiles = num_tiles(m, n, batches, config)
    if num_programs is None:
        num_programs = min(devices.num_compute_units(a.device), tiles * config.split_k)
    last_slice_sum_bytes = config.split_k * config.partial_bytes
    if tiles * config.split_k <= num_programs and (config.split_k == 1 or
                                                   last_slice_sum_bytes <= LAST_SLICE_SUM_MAX_BYTES):
        # One wave: each program has at most one unit, and one whose SM is held by other
        # work runs it as soon as a thief could have (when one of ours or the other work
        # frees an SM). Stealing would buy nothing; its claims cost ~1 us (NOTES.md step 13).
        # With split-K, unless the tile's last slice would read too many partials alone.
        schedule = Schedule.STATIC
    numel = counter_elements(num_shards, tiles, config.split_k)
    if type(a) in _PLAIN and a.device.type in ("cuda", "cpu"):
        counters = zeroed_counters(numel, a.device)
    else:  # traced: the zeros enter the graph
        counters = torch.zeros(numel, dtype=torch.int32, device=a.device)
    # Triton launches on the current device, and descriptor scratch is allocated there.
    guard = torch.cuda._DeviceGuard(a.device.index) if a.is_cuda else contextlib.nullcontext()
    try:
        with guard:
            compiled, args = launch(a3, b3, c3, bias, alpha, beta,
                                    counters, config=config, num_shards=num_shards,
                                    num_programs=num_programs, schedule=schedule, use_tma=use_tma)
    except BaseException:
        discard_counters(counters)
        raise
    if plan_key is not None:
        # The plan keeps no tensor: operands, output and buffers are the call's own (the
        # descriptors keep their layout and get the call's tensors as bases).
        kept = [None if isinstance(value, torch.Tensor) else _rebased(value, None)
                if isinstance(value, TensorDescriptor) else value
                for value in (args[name] for name in ws_matmul_kernel.arg_names)]
        _remember(plan_key, _Plan(
            kernel=compiled, args=kept,
            out_shape=c.shape, grid=num_programs, counters_numel=numel,
            partials_numel=args["partials_ptr"].numel() if config.split_k > 1 else 0,
            fix_a=fix_a, fix_b=fix_b, swap_ab=config.swap_ab,
            has_bias=bias is not None,
        ))
    return c


# ---------------------------------------------------------------------------------------
# The cached eager launch: an eager call with the default knobs looks up what the shapes
# decided on the first call with that key and launches Triton's compiled kernel directly,
# skipping Triton's argument binding (~30 us a call on the H200) and, on the Triton it was
# written against, the launcher's Python wrapper too (_DirectLaunch).
# ---------------------------------------------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))  # not fake, not functional
MAX_PLANS = 1024


@dataclasses.dataclass
class _Plan:
    kernel: object  # Triton's CompiledKernel, specialized for this key
    args: list  # the kernel's arguments in order; operands, buffers and scalars change per call
    out_shape: torch.Size
    grid: int
    counters_numel: int
    partials_numel: int
    fix_a: str  # _operand_fix's answer: how each operand is copied first, if at all
    fix_b: str
    swap_ab: bool  # B goes in A's place and A in B's (the plan's strides say how)
    has_bias: bool
    direct: "_DirectLaunch | None" = None  # Triton's C launcher, if _DirectLaunch.build could


_plans: dict = {}
_SLOT = {name: i for i, name in enumerate(ws_matmul_kernel.arg_names)}


def _plan_key(a, b, bias, alpha, beta) -> tuple:
    """Everything the launch depends on besides the data: shapes, strides, dtype, device,
    the operands' 16-byte alignment (Triton specializes on it; so does the TMA choice),
    the bias's layout, the special values of alpha and beta, TF32 and the shard setting."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.get_device(),
            None if bias is None else (bias.shape, bias.stride(), bias.data_ptr() % 16),
            a.data_ptr() % 16, b.data_ptr() % 16, alpha == 0, beta == 0,
            a.dtype == torch.float32 and tf32_enabled(), os.environ.get(devices.SHARDS_ENV))


def _rebased(descriptor: TensorDescriptor, base: torch.Tensor | None) -> TensorDescriptor:
    """The descriptor over another tensor of the same layout (no re-validation: the plan's
    key guarantees the layout and alignment). A field-for-field copy: 0.5 us, where
    copy.copy takes 2.4 us and the constructor 2.0 (on a CPU of the CI's kind), three times
    per cached launch."""
    rebased = object.__new__(TensorDescriptor)
    rebased.__dict__.update(descriptor.__dict__)
    rebased.base = base
    return rebased


def _remember(key: tuple, plan: _Plan) -> None:
    if plan.kernel is None or not hasattr(plan.kernel, "run"):
        return  # not a compiled kernel (an asynchronous compile still running): next time
    plan.direct = _DirectLaunch.build(plan.kernel, plan.args)
    if len(_plans) >= MAX_PLANS:
        del _plans[next(iter(_plans))]  # the oldest
    _plans[key] = plan


def _idle(hook) -> bool:
    """No launch hook to call: None, or an empty HookChain (what Triton 3.6 holds when no
    profiler has added one: never None there)."""
    return hook is None or (isinstance(hook, _HOOK_CHAIN) and not hook.calls)


_HOOK_CHAIN = getattr(knobs, "HookChain", ())
_POINTERS = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "counters_ptr", "partials_ptr")
_DESCRIBED = {f"{t}_desc": _POINTERS.index(f"{t}_ptr") for t in "abc"}  # descriptor -> its tensor
DIRECT_LAUNCH_TRITON = "3.6."  # the launcher _DirectLaunch builds arguments for
ENCODED_PER_SLOT = 8  # descriptors kept per operand, by address (a weight's never changes)


class _DirectLaunch:
    """A compiled kernel's C launcher, called with the argument list that Triton 3.6's Python
    wrapper (CudaLauncher and wrap_handle_tensordesc) would build: tensors as their data
    pointers, each tensor descriptor expanded into its CUtensorMap, shape and strides. A
    cached call then skips that wrapper's walk over all ~45 arguments, its per-descriptor
    Python and the launcher's pointer check per tensor (the call's tensors are on the plan's
    device by its key). A CUtensorMap depends only on the base address once the plan fixes
    the layout, so the last few encoded per operand are kept by address.

    build() returns None, and calls take Triton's own launcher, on any other Triton or
    launcher shape (a kernel that needs scratch memory, a descriptor lowered otherwise)."""

    def __init__(self, launch, kernel, args, pointer_slots, descriptor_slots, scalar_slots, fill):
        self.launch = launch
        self.head = (kernel.function, kernel.run.launch_cooperative_grid, kernel.run.launch_pdl,
                     None, None, kernel.packed_metadata, None, None, None)
        self.args = args  # the expanded argument list; the call's own go into the slots
        self.pointer_slots = pointer_slots  # ((index in _POINTERS, position), ...)
        self.descriptor_slots = descriptor_slots  # ((position, index in _POINTERS, fill args, cache), ...)
        self.alpha_slot, self.beta_slot = scalar_slots
        self.fill = fill

    @classmethod
    def build(cls, kernel, plan_args: list) -> "_DirectLaunch | None":
        run = getattr(kernel, "run", None)
        launch = getattr(run, "launch", None)
        if (not triton.__version__.startswith(DIRECT_LAUNCH_TRITON) or launch is None
                or getattr(run, "global_scratch_size", 1) != 0
                or getattr(run, "profile_scratch_size", 1) != 0):
            return None
        metas = None
        if hasattr(launch, "__code__"):  # wrap_handle_tensordesc's closure over the C function
            cells = dict(zip(launch.__code__.co_freevars, launch.__closure__ or ()))
            if "launcher" not in cells or "tensordesc_meta" not in cells:
                return None
            launch, metas = cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents
        try:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        except (ImportError, AttributeError):
            return None
        args, pointer_slots, descriptor_slots, scalar_slots, described = [], [], [], [], 0
        for name, value in zip(ws_matmul_kernel.arg_names, plan_args):
            if isinstance(value, TensorDescriptor):
                meta = metas[described] if metas else None
                described += 1
                if meta is None or meta.get("fp4_padded"):
                    return None  # lowered to pointers, or packed: Triton's wrapper knows how
                fill_args = (meta["swizzle"], meta["elem_size"],
                             TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                             list(value.shape), list(value.strides), int(value.padding == "nan"))
                descriptor_slots.append((len(args), _DESCRIBED[name], fill_args, {}))
                args += [None, *value.shape, *value.strides]
                continue
            if name in _POINTERS:
                pointer_slots.append((_POINTERS.index(name), len(args)))
            elif name in ("alpha", "beta"):
                scalar_slots.append(len(args))
            args.append(value)
        if metas and described != len(metas):
            return None
        return cls(launch, kernel, args, tuple(pointer_slots), tuple(descriptor_slots),
                   tuple(scalar_slots), fill)

    def __call__(self, grid: int, stream: int, pointers: tuple, alpha: float, beta: float) -> None:
        """pointers: the data pointers of _POINTERS' tensors, None for absent ones."""
        args = self.args.copy()
        for index, slot in self.pointer_slots:
            args[slot] = pointers[index]
        for slot, index, fill_args, encoded in self.descriptor_slots:
            address = pointers[index]
            tensor_map = encoded.get(address)
            if tensor_map is None:
                tensor_map = self.fill(address, *fill_args)
                if len(encoded) >= ENCODED_PER_SLOT:
                    encoded.pop(next(iter(encoded)), None)  # the oldest
                encoded[address] = tensor_map
            args[slot] = tensor_map
        args[self.alpha_slot], args[self.beta_slot] = alpha, beta
        self.launch(grid, 1, 1, stream, *self.head, *args)


def _cached_launch(a, b, bias, alpha, beta) -> torch.Tensor:
    key = _plan_key(a, b, bias, alpha, beta)
    plan = _plans.get(key)
    if plan is None:
        return _ws_matmul(a, b, bias, alpha, beta, config=None, num_shards=None,
                          num_programs=None, schedule=Schedule.WORK_STEALING, use_tma=None,
                          plan_key=key)
    index = a.get_device()
    if torch._C._cuda_getDevice() != index:  # Triton launches on the current device
        with torch.cuda._DeviceGuard(index):
            return _launch_plan(plan, a, b, bias, alpha, beta)
    return _launch_plan(plan, a, b, bias, alpha, beta)


def _launch_plan(plan: _Plan, a, b, bias, alpha, beta) -> torch.Tensor:
    device = a.device
    a_arg = _fixed(a, plan.fix_a) if plan.fix_a else a
    b_arg = _fixed(b, plan.fix_b) if plan.fix_b else b
    if plan.swap_ab:
        a_arg, b_arg = b_arg, a_arg
    c = torch.empty(plan.out_shape, dtype=a.dtype, device=device)
    counters = zeroed_counters(plan.counters_numel, device)
    partials = (torch.empty(plan.partials_numel, dtype=torch.float32, device=device)
                if plan.partials_numel else None)
    bias = bias if plan.has_bias else None
    kernel, stream = plan.kernel, torch._C._cuda_getCurrentRawStream(device.index)
    enter_hook, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _idle(enter_hook) and _idle(exit_hook):
        if plan.direct is not None:
            pointers = (a_arg.data_ptr(), b_arg.data_ptr(), c.data_ptr(),
                        bias.data_ptr() if bias is not None else None, counters.data_ptr(),
                        partials.data_ptr() if partials is not None else None)  # as _POINTERS
            plan.direct(plan.grid, stream, pointers, alpha, beta)
            return c
        enter_hook = exit_hook = None  # no metadata to build, no hook to call
    args = plan.args.copy()
    for name, t in zip(_POINTERS, (a_arg, b_arg, c, bias, counters, partials)):
        args[_SLOT[name]] = t
    args[_SLOT["alpha"]], args[_SLOT["beta"]] = alpha, beta
    for slot, base in ((_SLOT["a_desc"], a_arg), (_SLOT["b_desc"], b_arg), (_SLOT["c_desc"], c)):
        if args[slot] is not None:
            args[slot] = _rebased(args[slot], base)
    metadata = kernel.launch_metadata((plan.grid, 1, 1), stream, *args) if enter_hook else None
    kernel.run(plan.grid, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata,
               enter_hook, exit_hook, *args)
    return c


# Under the static schedule a split-K tile's last slice sums every partial alone; work
# stealing spreads the sums over all programs but pays ~3 more atomic round trips on the
# way (claims, arrival checks). On one-wave H200 launches the static sum won up to 256 KB
# of partials (2-4 slices of 128x128: 2-6%) and lost at 1 MB (16 slices: 25%), NOTES.md
# step 14.
LAST_SLICE_SUM_MAX_BYTES = 256 * 1024

# A copy that aligns an operand's rows for tensor descriptors reads and writes it once; it
# pays when the GEMM does at least this many FLOPs per byte copied (with the copies, two
# unaligned corpus shapes ran 3x and 15x faster on the H200 than on pointer loads: NOTES.md).
ALIGN_MIN_FLOPS_PER_BYTE = 200
# Under TF32 a K-major copy makes the GEMM itself ~4x faster (1000^3 on the H200: 62 us
# with a row-major B, 16 us with B K-major), so copies pay from far smaller GEMMs.
TF32_COPY_MIN_FLOPS_PER_BYTE = 64
# The copies pad rows to whole 128-byte lines, not to the 16 bytes descriptors need: a box
# row that starts mid-line touches two lines (3000x5000x2000 on the H200: B's 10000-byte
# rows cost ws 13% of its time and torch.mm 1%, NOTES.md step 16).
COPY_ROW_BYTES = 128


def _aligning_pays(a: torch.Tensor, b: torch.Tensor,
                   min_flops_per_byte: int = ALIGN_MIN_FLOPS_PER_BYTE) -> bool:
    """For (B, M, K) and (B, K, N) operands, not while tracing (no data to copy yet)."""
    if is_fake(a):
        return False
    batches, m, k = a.shape
    n = b.shape[2]
    copied_bytes = 2 * a.element_size() * batches * (m * k + k * n)
    return 2 * batches * m * n * k >= min_flops_per_byte * copied_bytes


def _operand_fix(t: torch.Tensor, align: bool, k_dim: int | None = None) -> str:
    """How a (B, rows, cols) operand is passed: as it is (""); when aligning pays, copied
    into rows or columns padded to COPY_ROW_BYTES ("rows", "columns") if descriptors cannot read
    it as it is, or if `k_dim` is given and K is not its contiguous dimension; or copied to
    row-major ("contiguous": with no unit stride every load would be a gather)."""
    if align and ((k_dim is not None and t.stride(k_dim) != 1)
                  or not _tma_compatible(t, traced=False)):
        return "columns" if k_dim == 1 else "rows"
    return "" if t.stride(-1) == 1 or t.stride(-2) == 1 else "contiguous"


def _fixed(t: torch.Tensor, fix: str) -> torch.Tensor:
    if fix == "rows":
        per_line = COPY_ROW_BYTES // t.element_size()  # elements
        cols = t.shape[-1]
        padded = t.new_empty(*t.shape[:-1], -(-cols // per_line) * per_line)
        return relayout.copy_into(padded[..., :cols], t)
    if fix == "columns":
        return _fixed(t.mT, "rows").mT
    if fix == "contiguous":
        return t.contiguous()
    return t

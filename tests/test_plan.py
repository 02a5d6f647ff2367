"""Launch planning (tritonblas_ops/plan.py): the decisions a launch takes from the operands'
layouts, checked without running anything, and the layouts the executors then produce."""

import dataclasses
import itertools

import pytest
import torch

from tritonblas_ops import device as devices
from tritonblas_ops import launch, settings
from tritonblas_ops.config import WARP_SPECIALIZED_TILES, TileConfig
from tritonblas_ops.plan import (
    COPY_ROW_BYTES,
    LAST_SLICE_SUM_MAX_BYTES,
    Kernel,
    Knobs,
    Operand,
    OperandCopy,
    Outcome,
    Schedule,
    plan,
)
from tritonblas_ops.warp_specialized_kernel import warp_specialized_matmul_kernel

from tiles import chunk_ends

SMALL = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
GPU = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch):
    """Device facts of an H200 for planning on a machine without one (nothing launches)."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    monkeypatch.setattr(devices, "has_tma", lambda device: device.type == "cuda")
    monkeypatch.delenv(devices.SHARDS_ENV, raising=False)
    monkeypatch.setattr(devices, "default_num_shards", lambda device: 1)


def row_major(*shape, size=2, aligned=True):
    b, r, c = shape
    return Operand(shape, (r * c, c, 1), size, aligned)


def column_major(*shape, size=2, aligned=True):
    b, r, c = shape
    return Operand(shape, (r * c, 1, r), size, aligned)


def gpu_plan(a, b, bias=None, *, dtype=torch.bfloat16, tf32=False, **kwargs):
    defaults = dict(batched=False, dtype=dtype, device=GPU, alpha_zero=False, beta_zero=False, tf32=tf32)
    return plan(a, b, bias, **{**defaults, **kwargs})


def test_outcomes_without_a_product(h200):
    a, b = row_major(1, 64, 32), row_major(1, 32, 48)
    bias = Operand((48,), (1,), 2, None)
    assert gpu_plan(row_major(1, 0, 32), b).outcome is Outcome.EMPTY
    assert gpu_plan(row_major(1, 64, 0), row_major(1, 0, 48)).outcome is Outcome.FILL
    filled = gpu_plan(a, b, bias, alpha_zero=True)
    assert filled.outcome is Outcome.FILL and filled.keep_bias
    dropped = gpu_plan(a, b, bias, beta_zero=True)
    assert dropped.outcome is Outcome.LAUNCH and not dropped.keep_bias and dropped.strides[3] == (0, 0)


def test_one_wave_launches_take_the_static_schedule():
    """No more work units than programs: each program has one unit at most, nothing to
    steal, so no claims; more units than programs: work stealing. One wave of split-K keeps
    work stealing when the static schedule's last slice would sum more than
    LAST_SLICE_SUM_MAX_BYTES of partials alone."""
    a, b = torch.randn(40, 30), torch.randn(30, 50)  # 3 x 4 tiles of SMALL

    def work_stealing(a, b, config, programs):
        return launch.plan_for(a, b, None, 1.0, 1.0, Knobs(config, num_programs=programs)).queue.work_stealing

    assert work_stealing(a, b, SMALL, None)  # the interpreter's 4 programs
    assert not work_stealing(a, b, SMALL, 12) and not work_stealing(a, b, SMALL, 16)
    a, b = torch.randn(40, 600), torch.randn(600, 50)  # one tile of each config below
    small, large = TileConfig(64, 64, 32, split_k=3), TileConfig(128, 128, 32, split_k=16)
    assert small.split_k * small.partial_bytes <= LAST_SLICE_SUM_MAX_BYTES < large.split_k * large.partial_bytes
    assert not work_stealing(a, b, small, 16)
    assert work_stealing(a, b, large, 16)
    forced = launch.plan_for(a, b, None, 1.0, 1.0, Knobs(small, num_programs=16, schedule=Schedule.STATIC))
    assert not forced.queue.work_stealing


def test_decode_shapes_are_planned_transposed(h200):
    """M <= 16: C^T = B^T @ A^T, so the kernel's A is B^T, its B is A^T and C is C^T, and a
    row bias (N,) becomes a column one."""
    a, b = row_major(1, 5, 4096), row_major(1, 4096, 4000)
    bias = Operand((4000,), (1,), 2, None)
    swapped = gpu_plan(a, b, bias)
    assert swapped.swap_ab and swapped.sizes == (4000, 5, 4096, 1)
    stride_a, stride_b, stride_c, stride_bias = swapped.strides
    assert stride_a == (4096 * 4000, 1, 4000)  # B^T: column-major (4000, 4096)
    assert stride_b == (5 * 4096, 1, 4096)  # A^T
    assert stride_c == (5 * 4000, 1, 4000)  # C^T
    assert stride_bias == (1, 0)
    assert not swapped.tma_store  # C^T is column-major


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unaligned_rows_are_copied_into_whole_lines_where_it_pays(h200, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    big = gpu_plan(row_major(1, 4095, 4093, size=size), row_major(1, 4093, 4097, size=size), dtype=dtype)
    assert (big.copy_a, big.copy_b) == (OperandCopy.ROWS, OperandCopy.ROWS)
    assert big.use_tma and big.host_descriptors
    for stride in big.strides[:2]:
        assert (stride[1] * size) % COPY_ROW_BYTES == 0 and stride[2] == 1
    small = gpu_plan(row_major(1, 100, 99, size=size), row_major(1, 99, 101, size=size), dtype=dtype)
    assert (small.copy_a, small.copy_b) == (OperandCopy.NONE, OperandCopy.NONE) and not small.use_tma
    traced = gpu_plan(row_major(1, 4095, 4093, size=size), row_major(1, 4093, 4097, size=size),
                      dtype=dtype, traced=True)
    assert traced.copy_a is OperandCopy.NONE and not traced.host_descriptors
    no_unit_stride = Operand((1, 64, 32), (64 * 64, 64, 2), size, True)
    assert gpu_plan(no_unit_stride, row_major(1, 32, 48, size=size), dtype=dtype).copy_a is OperandCopy.CONTIGUOUS


def test_tf32_operands_are_planned_k_major(h200):
    """wgmma reads TF32 operands K-major only: where copies pay, B gets K-contiguous columns
    and A K-contiguous rows; layouts that already have them are left alone."""
    def copies(a, b):
        planned = gpu_plan(a, b, dtype=torch.float32, tf32=True)
        return planned.copy_a, planned.copy_b, planned.input_precision

    n = 2048
    assert copies(row_major(1, n, n, size=4), row_major(1, n, n, size=4)) == (
        OperandCopy.NONE, OperandCopy.COLUMNS, "tf32")
    assert copies(row_major(1, n, n, size=4), column_major(1, n, n, size=4))[:2] == (OperandCopy.NONE,) * 2
    assert copies(column_major(1, n, n, size=4), column_major(1, n, n, size=4))[:2] == (
        OperandCopy.ROWS, OperandCopy.NONE)
    assert copies(row_major(1, 64, 64, size=4), row_major(1, 64, 64, size=4))[:2] == (OperandCopy.NONE,) * 2


def used_strides(t: Operand) -> tuple:
    """The strides a launch steps along: one batch's stride is never used."""
    return t.stride if t.shape[0] > 1 else t.stride[1:]


LAYOUTS = {
    "row": lambda *s: torch.randn(*s),
    "column": lambda *s: torch.randn(*s).mT.contiguous().mT,
    "sliced": lambda *s: torch.randn(*s[:-1], s[-1] + 3)[..., 1:],
    "no unit stride": lambda *s: torch.randn(*s[:-2], 2 * s[-2], 2 * s[-1])[..., ::2, ::2],
}


@pytest.mark.parametrize("copy", list(OperandCopy))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 7), (2, 13, 777), (1, 4, 8)])
def test_copies_have_the_planned_layout(shape, dtype, copy):
    """launch.copy_operand gives exactly the strides plan.Operand.copied predicts (the plan
    launches with those), the same values, and rows or columns on whole lines."""
    t = torch.randn(*shape, dtype=dtype).mT.contiguous().mT  # column-major
    copied = launch.copy_operand(t, copy)
    assert torch.equal(copied, t)
    assert used_strides(Operand.of(copied, traced=False)) == used_strides(
        Operand.of(t, traced=False).copied(copy))
    if copy in (OperandCopy.ROWS, OperandCopy.COLUMNS):
        unit = -1 if copy is OperandCopy.ROWS else -2
        other = -2 if copy is OperandCopy.ROWS else -1
        assert copied.stride(unit) == 1 and (copied.stride(other) * copied.element_size()) % COPY_ROW_BYTES == 0


@pytest.mark.parametrize("a_layout,b_layout", list(itertools.product(LAYOUTS, repeat=2)))
def test_the_kernel_gets_the_layouts_the_plan_names(a_layout, b_layout, h200):
    """Whatever an H200's plan copies and swaps, the tensors the executor hands the kernel
    have the strides the plan launches with (their data pointers are what it passes)."""
    seen = set()
    for m, n, k in [(40, 48, 56), (5, 4000, 64), (2049, 1023, 777)]:
        a, b = LAYOUTS[a_layout](m, k).bfloat16(), LAYOUTS[b_layout](k, n).bfloat16()
        the_plan = gpu_plan(Operand.of(a, traced=False), Operand.of(b, traced=False))
        seen |= {the_plan.copy_a, the_plan.copy_b, the_plan.swap_ab}
        a_arg, b_arg, _, _ = launch.operands(the_plan, a, b, None)
        if the_plan.swap_ab:
            a_arg, b_arg = a_arg.mT, b_arg.mT  # the kernel's A is B^T, its B is A^T
        assert used_strides(Operand.of(a_arg, traced=False)) == the_plan.strides[0][1:]
        assert used_strides(Operand.of(b_arg, traced=False)) == the_plan.strides[1][1:]
    assert True in seen  # the decode shape ran transposed


M3, K4, N5 = 3, 4, 5
INT64_CASES = {
    # name: (layouts replacing those of the (1, 3, 4) @ (1, 4, 5) -> (1, 3, 5) operands and
    # the (3, 5) bias, as (shape, stride); whether offsets need int64)
    "small contiguous": ({}, False),
    "a rows 2**30 apart": ({"a": ((1, M3, K4), (M3 * 2**30, 2**30, 1))}, True),
    "b columns 2**29 apart": ({"b": ((1, K4, N5), (N5 * 2**29, 1, 2**29))}, True),
    "output rows 2**30 apart": ({"c": ((1, M3, N5), (M3 * 2**30, 2**30, 1))}, True),
    "bias rows 2**30 apart": ({"bias": ((M3, N5), (2**30, 1))}, True),
    "batch stride 2**30": ({"a": ((3, M3, K4), (2**30, K4, 1)), "b": ((3, K4, N5), (K4 * N5, N5, 1))},
                           True),
    "largest offset 2**31 exactly": ({"a": ((1, 2, 1), (2**31, 2**31, 1)), "b": ((1, 1, N5), (N5, N5, 1)),
                                      "bias": None}, True),
    "largest offset well inside int32": ({"a": ((1, M3, K4), (M3 * 2**29, 2**30 - 2**20, 1))}, False),
    # Size-1 dimensions are never stepped along, whatever their stride.
    "huge strides on size-1 dims": ({"a": ((1, 1, K4), (2**40, 2**40, 1)), "bias": ((1, N5), (2**40, 1))},
                                    False),
}


@pytest.mark.parametrize("name", list(INT64_CASES))
def test_int64_indexing_exactly_when_an_offset_reaches_2_31(name):
    layouts, int64 = INT64_CASES[name]
    layouts = {"a": ((1, M3, K4), (M3 * K4, K4, 1)), "b": ((1, K4, N5), (K4 * N5, N5, 1)),
               "bias": ((M3, N5), (N5, 1)), **layouts}
    a, b = (Operand(*layouts[name], 2, True) for name in "ab")
    bias = Operand(*layouts["bias"], 2, None) if layouts["bias"] else None
    if "c" in layouts:
        out = Operand(*layouts["c"], 2, True)
    else:
        out = Operand((a.shape[0], a.shape[1], b.shape[2]),
                      (a.shape[1] * b.shape[2], b.shape[2], 1), 2, True)
    planned = plan(a, b, bias, batched=True, dtype=torch.float16, device=torch.device("cpu"),
                   alpha_zero=False, beta_zero=False, tf32=False,
                   knobs=Knobs(SMALL, num_shards=1, num_programs=2, use_tma=False), out=out)
    assert planned.int64_index == int64


def test_bad_knobs_are_refused():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for knobs in (Knobs(num_shards=0), Knobs(num_programs=0)):
        with pytest.raises(ValueError, match="need num_shards >= 1 and num_programs >= 1"):
            launch.plan_for(a, b, None, 1.0, 1.0, knobs)


def test_plans_are_frozen_and_cached_per_key():
    """A plan is data: equal operands give equal plans, and cached calls reuse the first."""
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    first = launch.plan_for(a, b, None, 1.0, 1.0)
    assert first == launch.plan_for(torch.randn(24, 40), torch.randn(40, 8), None, 1.0, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.grid = 3
    launch.clear_plans()
    launch.ws_matmul(a, b)
    launch.ws_matmul(torch.randn(24, 40), b)
    assert launch.cached_plans() == [first]


@pytest.mark.parametrize("n,k", [(4096, 14336), (1000, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batches", [1, 3])
def test_batch_invariant_plans_do_not_depend_on_m(h200, dtype, batches, n, k):
    """Batch-invariant: one K chunk count for every M and batch count of an (N, K), its
    chunks ending at the same K whatever the tile's K step; M picks the tile (16-bit decode
    the transposed problem's) and whether chunks run as split-K units (few rows) or in turn
    inside each tile (many, or sizes not known). The default plans' K splits change with M
    (so the check can fail)."""
    size = dtype.itemsize

    def configs(batch_invariant, **kwargs):
        return {gpu_plan(row_major(batches, m, k, size=size), row_major(batches, k, n, size=size),
                         dtype=dtype, batch_invariant=batch_invariant, **kwargs).config
                for m in (1, 5, 16, 17, 64, 128, 1000, 2048, 8192)}

    invariant = configs(True)
    (ends,) = {chunk_ends(config, k) for config in invariant}
    chunks = len(ends)
    assert (chunks > 1) == (n == 1000)
    assert {config.swap_ab for config in invariant} == ({False} if dtype == torch.float32 else {False, True})
    assert len(invariant) > 1  # the tile follows M
    splits = {config.split_k for config in invariant}
    assert splits == {1, chunks} if batches == 1 else splits <= {1, chunks}
    assert {config.split_k for config in configs(True, dynamic=True)} == {1}
    assert len({(config.block_k, config.split_k) for config in configs(False)}) > 1


def test_an_sm_budget_caps_the_grid_not_the_tile(h200):
    """Under a budget the grid shrinks (work stealing once the units outnumber it); the tile
    config, and so every result, stays the one without a budget."""
    a, b = row_major(1, 8192, 8192), row_major(1, 8192, 8192)
    free = gpu_plan(a, b)
    for programs in (1, 66, 116):
        capped = gpu_plan(a, b, max_programs=programs)
        assert capped.grid == programs and capped.config == free.config
        assert capped.queue.work_stealing
    a, b = row_major(1, 1024, 256), row_major(1, 256, 1024)  # fewer units than 100
    one_wave = gpu_plan(a, b)
    assert one_wave.grid < 100 and not one_wave.queue.work_stealing
    assert gpu_plan(a, b, max_programs=100).grid == one_wave.grid
    assert gpu_plan(a, b, max_programs=8).queue.work_stealing


@pytest.fixture
def hopper(h200, monkeypatch):
    """An H200's facts, wgmma included (the warp-specialized kernel's sm_90)."""
    monkeypatch.setattr(devices, "has_wgmma", lambda device: device.type == "cuda")


def test_the_warp_specialized_kernel_only_with_its_setting(hopper):
    a, b = row_major(1, 4096, 4096), row_major(1, 4096, 4096)
    assert gpu_plan(a, b).kernel is Kernel.TRITON
    chosen = gpu_plan(a, b, warp_specialize=True)
    assert chosen.kernel is Kernel.WARP_SPECIALIZED
    # Everything else is the Triton kernel's plan: the same tile, grid, queue and layouts.
    assert dataclasses.replace(chosen, kernel=Kernel.TRITON) == gpu_plan(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_layout,b_layout", [(row_major, row_major), (row_major, column_major),
                                               (column_major, row_major), (column_major, column_major)])
@pytest.mark.parametrize("m,n,k,batches", [(4096, 4096, 4096, 1), (3000, 5000, 2000, 1), (1000, 1024, 520, 8)])
def test_warp_specialized_plans_for_16_bit_describable_operands(hopper, dtype, a_layout, b_layout, m, n, k,
                                                                 batches):
    """bf16 and fp16, A and B either way round (B column-major: a weight's K-major storage),
    2-D or batched: the kernel reads each as the Triton kernel's descriptors describe it, and
    stores C in the subtiles of its tile's variant."""
    chosen = gpu_plan(a_layout(batches, m, k), b_layout(batches, k, n), dtype=dtype, batched=batches > 1,
                      warp_specialize=True)
    assert chosen.kernel is Kernel.WARP_SPECIALIZED
    config = chosen.config
    variant = WARP_SPECIALIZED_TILES[(config.block_m, config.block_n, config.block_k)]
    assert chosen.a_row_major is (a_layout is row_major) and chosen.b_row_major is (b_layout is row_major)
    c_layout = chosen.descriptor_layouts()[2]
    assert c_layout.shape == (batches, m, n) and c_layout.box == (1, config.block_m, variant.epilogue_n)
    assert chosen.launch_options == variant.launch_options


def test_warp_specialized_arguments_are_the_kernels(hopper):
    live = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    chosen = gpu_plan(row_major(1, 4096, 4096), row_major(1, 4096, 4096), Operand((4096,), (1,), 2, None),
                      warp_specialize=True, live_budget=live, activation="gate_silu", checked=True)
    args = chosen.warp_specialized_arguments("bias", "counters", ("a", "b", "c", None), 1.0, 1.0)
    assert list(args) == warp_specialized_matmul_kernel.arg_names
    assert args["budget_ptr"] is live and args["CHECKED"] and args["GATE"] and args["ACTIVATION"] == "silu"
    assert (args["stride_bias_m"], args["stride_bias_n"]) == (0, 1)


def test_batch_invariant_chunks_on_the_128x128_tile_run_warp_specialized(hopper):
    """Batch-invariant prefill with K in chunks (N = 1000, K = 14336): the 128x128 tile's
    chunks are summed in turn by the warp-specialized kernel's MMA warps (two accumulators
    fit)."""
    chosen = gpu_plan(row_major(1, 8192, 14336), row_major(1, 14336, 1000), batch_invariant=True,
                      warp_specialize=True)
    config = chosen.config
    assert (config.block_m, config.block_n, config.k_chunks > 1, config.split_k) == (128, 128, True, 1)
    assert chosen.kernel is Kernel.WARP_SPECIALIZED
    args = chosen.warp_specialized_arguments("bias", "counters", ("a", "b", "c", None), 1.0, 1.0)
    assert args["K_CHUNKS"] == config.k_chunks


@pytest.mark.parametrize("bias,prefetched", [
    (Operand((4096, 4096), (4096, 1), 2, True), True),  # a gate, a residual, a pre-activation
    (Operand((1, 4096, 4096), (4096 * 4104, 4104, 1), 2, True), True),  # rows of a wider tensor
    (Operand((4096,), (1,), 2, True), False),  # a row vector: broadcast rows, read from L2
    (Operand((4096, 1), (1, 1), 2, True), False),  # a column vector
    (Operand((4096, 4096), (1, 4096), 2, True), False),  # column-major
    (Operand((4096, 4096), (4100, 1), 2, True), False),  # rows of 8200 bytes: no descriptor
    (Operand((4096, 4096), (4096, 1), 2, False), False),  # a base 8 bytes off
    (Operand((4096, 4096), (4096, 1), 4, True), False),  # not C's dtype
])
def test_a_whole_bias_is_read_ahead_into_cs_buffers(hopper, bias, prefetched):
    """The warp-specialized kernel's loader reads an (M, N) bias that a descriptor can describe
    in C's layout during the K loop; the variant then keeps a C buffer per subtile, and the
    kernel gets the bias's descriptor layout (C's subtile box, one batch)."""
    a, b = row_major(1, 4096, 4096), row_major(1, 4096, 4096)
    chosen = gpu_plan(a, b, bias, warp_specialize=True, activation="gate_silu")
    assert chosen.kernel is Kernel.WARP_SPECIALIZED and chosen.prefetch_bias is prefetched
    config = chosen.config
    plain = WARP_SPECIALIZED_TILES[(config.block_m, config.block_n, config.block_k)]
    variant = chosen.warp_specialized_variant
    if not prefetched:
        assert variant == plain and chosen.bias_descriptor_layout() is None
        return
    assert variant.c_bufs == config.block_n // plain.epilogue_n and variant.stages == plain.prefetch_stages
    layout = chosen.bias_descriptor_layout()
    assert layout.shape == (1, 4096, 4096) and layout.strides[1:] == (bias.stride[-2], 1)
    assert layout.box == chosen.descriptor_layouts()[2].box
    args = chosen.warp_specialized_arguments("bias", "counters", ("a", "b", "c", "bias_desc"), 1.0, 1.0)
    assert args["bias_desc"] == "bias_desc" and args["C_BUFS"] == variant.c_bufs
    assert not gpu_plan(a, b, bias, activation="gate_silu").prefetch_bias  # the Triton kernel: pointer loads


@pytest.mark.parametrize("case", ["not_sm90", "fp32", "traced", "split_k", "k_chunks", "decode", "one_wave",
                                  "other_tile", "no_tma", "unaligned_c", "int64"])
def test_the_triton_kernel_keeps_what_the_warp_specialized_one_cannot_take(hopper, monkeypatch, case):
    a, b, kwargs = row_major(1, 4096, 4096), row_major(1, 4096, 4096), {}
    if case == "not_sm90":  # Blackwell, or AMD: no wgmma
        monkeypatch.setattr(devices, "has_wgmma", lambda device: False)
    elif case == "fp32":
        a, b = row_major(1, 4096, 4096, size=4), row_major(1, 4096, 4096, size=4)
        kwargs = dict(dtype=torch.float32, tf32=True)
    elif case == "traced":  # Inductor's inline form, fake tensors: descriptors made in the programs
        kwargs = dict(traced=True)
    elif case == "split_k":
        kwargs = dict(knobs=Knobs(TileConfig(128, 256, 64, split_k=2)))
    elif case == "k_chunks":
        kwargs = dict(knobs=Knobs(TileConfig(128, 256, 64, k_chunks=2)))
    elif case == "decode":  # swapped, 128x16 tiles
        a = row_major(1, 5, 4096)
    elif case == "one_wave":  # the static schedule
        a, b = row_major(1, 1024, 4096), row_major(1, 4096, 1024)
    elif case == "other_tile":
        kwargs = dict(knobs=Knobs(TileConfig(64, 128, 128)))
    elif case == "no_tma":
        kwargs = dict(knobs=Knobs(use_tma=False))
    elif case == "unaligned_c":  # C's rows of 4100 bytes: no descriptor, pointer stores
        b = row_major(1, 4096, 2050)
    elif case == "int64":  # the bias's offsets are int32 in the epilogue
        kwargs = dict(fits_int32=lambda offset: False)
    chosen = gpu_plan(a, b, warp_specialize=True, **{"dtype": torch.bfloat16, **kwargs})
    assert chosen.outcome is Outcome.LAUNCH and chosen.kernel is Kernel.TRITON


def test_cpu_launches_keep_the_triton_kernel():
    before = settings.update(warp_specialize=True)
    try:
        assert launch.plan_for(torch.randn(64, 64), torch.randn(64, 64), None, 1.0, 1.0).kernel is Kernel.TRITON
    finally:
        settings.restore(before)

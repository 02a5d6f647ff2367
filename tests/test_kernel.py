"""The kernel itself, run by Triton's interpreter on CPU tensors: numerics at ragged edges,
every layout, the scheduling guarantee, bitwise reproducibility, and what it does when its
counters are not all zero at launch."""

import dataclasses
import itertools
from unittest import mock

import pytest
import torch
import triton

from tritonblas_ops import activations, counters, interpreter, launch, relayout, scheduler
from tritonblas_ops.config import TileConfig
from tritonblas_ops.launch import ws_matmul
from tritonblas_ops.plan import Knobs, Schedule
from tritonblas_ops.testing import (
    REL_TOLERANCE,
    assert_every_unit_computed_once,
    assert_matches,
    matmul_ref,
)

pytestmark = pytest.mark.usefixtures("poison_empty")

SMALL = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)

ODD_SHAPES = [
    (1, 1, 1),
    (7, 13, 5),  # primes, all smaller than one tile
    (15, 17, 33),
    (257, 129, 300),
    (40, 50, 7),  # K smaller than one block
    (33, 65, 32),  # K exactly one block, M and N one past a tile
]


def operand(rows, cols, dtype, transposed):
    """A (rows, cols) operand, row-major or a transposed view of a column-major buffer."""
    if transposed:
        return torch.randn(cols, rows, dtype=dtype).t()
    return torch.randn(rows, cols, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
def test_matches_float64_reference(m, n, k, a_t, b_t, dtype):
    a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
    assert_matches(ws_matmul(a, b), matmul_ref(a, b), REL_TOLERANCE[dtype])


# Strides must be 16-byte multiples for tensor descriptors; the tile edges stay ragged.
TMA_SHAPES = [(8, 8, 8), (40, 24, 56), (136, 72, 152), (24, 40, 8)]


@pytest.mark.parametrize("made_by", ["host", "programs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", TMA_SHAPES)
def test_tensor_descriptor_path_matches_reference(m, n, k, a_t, b_t, dtype, made_by):
    """Descriptors built on the host (eager launches) or by each program (traced ones)."""
    def run(a, b, bias=None, alpha=1.0, beta=1.0, **knobs):
        knobs = Knobs(use_tma=True, host_descriptors=made_by == "host", **knobs)
        plan = launch.plan_for(a, b, bias, alpha, beta, knobs)
        assert plan.use_tma and plan.host_descriptors == (made_by == "host")
        return launch.execute(plan, a, b, bias, alpha, beta)[0]

    a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
    bias = torch.randn(n, dtype=dtype)
    out = run(a, b, bias, 0.5, 2.0, config=SMALL)
    assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=2.0), REL_TOLERANCE[dtype])
    a3, b3 = torch.randn(3, m, k, dtype=dtype), torch.randn(3, k, n, dtype=dtype)
    out = run(a3, b3, config=SMALL, num_programs=5)
    assert_matches(out, matmul_ref(a3, b3), REL_TOLERANCE[dtype])


def test_tensor_descriptors_refused_on_unaligned_strides():
    a, b = torch.randn(9, 7), torch.randn(7, 5)  # row strides of 28 and 20 bytes
    with pytest.raises(ValueError, match="use_tma=True needs 16-byte aligned operands"):
        ws_matmul(a, b, use_tma=True)


@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_batched_tiles_share_one_queue(num_shards):
    a, b = torch.randn(3, 37, 29), torch.randn(3, 29, 45)
    out = ws_matmul(a, b, config=SMALL, num_shards=num_shards, num_programs=5)
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.float32])


def test_odd_views_and_layouts():
    base = torch.randn(70, 90)
    sliced = base[3:43, 5:65]  # offset view with a leading stride of 90
    every_other = base[::2, ::3]  # no unit stride: copied to row-major first
    b = torch.randn(60, 20)
    assert_matches(ws_matmul(sliced, b), matmul_ref(sliced, b), REL_TOLERANCE[torch.float32])
    b2 = torch.randn(30, 20)
    out = ws_matmul(every_other, b2)
    assert_matches(out, matmul_ref(every_other, b2), REL_TOLERANCE[torch.float32])


def test_ragged_edge_tiles_never_write_outside_the_output():
    """The output is a window into a larger buffer: a wrapped or unmasked edge write (the
    `% M` defect of tritonBLAS PR #65) would land in the sentinel border."""
    m, n, k = 37, 41, 23
    a, b = torch.randn(m, k), torch.randn(k, n)
    sentinel = 12345.0
    buffer = torch.full((1, m + 9, n + 11), sentinel)
    out = buffer[:, 4 : 4 + m, 5 : 5 + n]
    out.fill_(float("nan"))
    plan = launch.plan_for(a, b, None, 1.0, 1.0, Knobs(SMALL, num_shards=2, num_programs=3), out=out)
    counters = torch.zeros(plan.queue.numel, dtype=torch.int32)
    launch.launch_kernel(plan, a, b, out, None, counters, None, 1.0, 1.0)
    assert_matches(out[0], matmul_ref(a, b), REL_TOLERANCE[torch.float32])
    border = torch.ones_like(buffer, dtype=torch.bool)
    border[:, 4 : 4 + m, 5 : 5 + n] = False
    assert (buffer[border] == sentinel).all(), "the kernel wrote outside the output window"


@pytest.mark.parametrize("split_k,split_tail", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("num_programs", [1, 3, 5, 16])
@pytest.mark.parametrize("num_shards", [1, 2, 6, 8])
def test_every_tile_computed_exactly_once(num_shards, num_programs, schedule, split_k, split_tail):
    """With a split tail: 2 batches of 4 x 5 tiles fill 10 whole waves of the interpreter's 4
    "SMs" (nothing split); one batch of 3 x 5 tiles leaves 3 tiles to split."""
    config = dataclasses.replace(SMALL, split_k=split_k, split_tail=split_tail)
    for batches, m in [(2, 50), (1, 40)]:
        a, b = torch.randn(batches, m, 40), torch.randn(batches, 40, 70)
        assert_every_unit_computed_once(a, b, config, num_shards=num_shards, num_programs=num_programs,
                                        schedule=schedule, tolerance=REL_TOLERANCE[torch.float32])


def test_launches_share_one_counter_buffer_left_at_zero():
    """Eager launches on one device (and on a GPU, one stream) share a counter buffer,
    zeroed when it is made or grown and left at zero by every launch, so none fills its own:
    work stealing over 3 shards, then split-K (more counters: the buffer grows), then 8
    shards with more programs than units for some shards."""
    cases = [(SMALL, 3, 5), (dataclasses.replace(SMALL, split_k=3), 2, 4), (SMALL, 8, 3)]
    for config, shards, programs in cases:
        a, b = torch.randn(37, 50), torch.randn(50, 29)
        knobs = Knobs(config, shards, programs)
        out = ws_matmul(a, b, config=config, num_shards=shards, num_programs=programs)
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.float32])
        queue = launch.plan_for(a, b, None, 1.0, 1.0, knobs).queue
        buffer = counters.zeroed(queue.numel, torch.device("cpu"))  # the one the launch used
        assert queue.problems(buffer.tolist()) == [] and (buffer == 0).all(), (config, shards, programs)


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_matches_the_reference_and_is_bitwise_reproducible(split_k, dtype):
    """K slices summed in slice order (by sum units of a few rows each under work stealing,
    by the tile's last slice under the static schedule): right at ragged edges (K not a
    multiple of the block or of the split, slices that get no K), with the bias epilogue
    applied once, and bitwise equal whatever the schedule and grid."""
    config = dataclasses.replace(SMALL, split_k=split_k)
    tol = REL_TOLERANCE[dtype]
    for m, n, k in [(37, 41, 100), (16, 16, 17), (20, 9, 3)]:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        bias = torch.randn(n, dtype=dtype)
        first = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=config, num_programs=1)
        assert_matches(first, matmul_ref(a, b, bias, alpha=1.5, beta=-0.5), tol)
        for shards, programs, schedule in [(2, 5, Schedule.WORK_STEALING), (1, 3, Schedule.STATIC)]:
            again = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=config, num_shards=shards,
                              num_programs=programs, schedule=schedule)
            assert torch.equal(again, first), (m, n, k, shards, programs, schedule)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_split_tail_is_whole_tiles_then_split_ones(dtype):
    """A split tail (the tiles past the device's whole waves split, the others whole): each
    whole tile is bitwise the unsplit launch's, each split one the split launch's (the same
    slices summed in the same order), whatever the grid and schedule; ragged K, a bias."""
    config = dataclasses.replace(SMALL, split_k=3)
    tail = dataclasses.replace(config, split_tail=True)
    m, n, k = 45, 40, 100  # 3 x 3 tiles of 16 x 16: 8 whole on the interpreter's 4 "SMs", 1 split
    a, b, bias = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.randn(n, dtype=dtype)
    whole = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=SMALL)
    split = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=config)
    queue = launch.plan_for(a, b, bias, 1.5, -0.5, Knobs(tail)).queue
    assert (queue.whole_tiles, queue.split_tiles, queue.product_units) == (8, 1, 11)
    last = (slice(32, None), slice(32, None))  # the last tile in the swizzled order: (2, 2)
    expected = whole.clone()
    expected[last] = split[last]
    assert not torch.equal(whole[last], split[last]) or dtype != torch.float32
    for programs, schedule in [(4, Schedule.WORK_STEALING), (1, Schedule.WORK_STEALING),
                               (7, Schedule.WORK_STEALING), (3, Schedule.STATIC)]:
        out = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=tail, num_programs=programs, schedule=schedule)
        assert torch.equal(out, expected), (programs, schedule)
    assert_matches(out, matmul_ref(a, b, bias, alpha=1.5, beta=-0.5), REL_TOLERANCE[dtype])


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_k_chunks_summed_in_a_tile_or_as_split_k_units_give_the_same_bits(dtype, tma):
    """K in chunks (batch-invariant configs): summed one after another inside each tile, or
    each chunk a split-K unit, or a split tail of them (whole tiles summing in turn, the
    rest split into their chunks), under either schedule: the same bits, and the
    reference's values. Without chunks, whole K in one accumulator differs from the split in
    fp32 (so the comparison can fail; fp16's rounding of the output mostly hides the
    difference)."""
    chunked = dataclasses.replace(SMALL, k_chunks=3)
    tol = REL_TOLERANCE[dtype]
    differs = False
    whole_tiles = 0  # of the tails: 4 of (40, 24)'s 6 tiles on the interpreter's 4 "SMs"
    for m, n, k in [(40, 24, 160), (16, 32, 48), (24, 8, 120)]:  # 10, 3 and 8 K steps
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        bias = torch.randn(n, dtype=dtype)
        in_tile = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=chunked, use_tma=tma)
        assert_matches(in_tile, matmul_ref(a, b, bias, alpha=1.5, beta=-0.5), tol)
        for programs, schedule, tail in [(5, Schedule.WORK_STEALING, False), (2, Schedule.STATIC, False),
                                         (5, Schedule.WORK_STEALING, True), (2, Schedule.STATIC, True)]:
            config = dataclasses.replace(chunked, split_k=3, split_tail=tail)
            whole_tiles = max(whole_tiles, launch.plan_for(a, b, bias, 1.5, -0.5, Knobs(config)).queue.whole_tiles)
            split = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=config,
                              num_programs=programs, schedule=schedule, use_tma=tma)
            assert torch.equal(split, in_tile), (m, n, k, programs, schedule, tail)
        whole = ws_matmul(a, b, bias, alpha=1.5, beta=-0.5, config=SMALL, use_tma=tma)
        differs |= not torch.equal(whole, in_tile)
    assert differs or dtype != torch.float32
    assert whole_tiles == 4
    with pytest.raises(ValueError, match="k_chunks=3"):
        ws_matmul(a, b, config=dataclasses.replace(chunked, split_k=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bitwise_identical_whatever_the_schedule(dtype):
    a, b = torch.randn(45, 300, dtype=dtype), torch.randn(300, 38, dtype=dtype)
    first = ws_matmul(a, b, config=SMALL, num_shards=1, num_programs=1)
    for shards, programs, schedule in [(1, 1, Schedule.WORK_STEALING), (8, 3, Schedule.WORK_STEALING),
                                       (3, 7, Schedule.WORK_STEALING), (1, 4, Schedule.STATIC)]:
        again = ws_matmul(a, b, config=SMALL, num_shards=shards, num_programs=programs,
                          schedule=schedule)
        assert torch.equal(again, first), (shards, programs, schedule)


@pytest.mark.parametrize("k", [0, 1, 15, 16, 17])
def test_small_k(k):
    """K of zero, one, or about one block: no loop-count assumption may break these."""
    a, b = torch.randn(20, k), torch.randn(k, 24)
    out = ws_matmul(a, b, config=SMALL)
    if k == 0:  # torch.mm's answer; the reference's norm is zero
        assert torch.equal(out, torch.zeros(20, 24))
    else:
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.float32])


def test_bias_epilogue_with_alpha_and_beta():
    a, b = torch.randn(30, 20), torch.randn(20, 25)
    for bias in [torch.randn(25), torch.randn(1, 25), torch.randn(30, 1), torch.randn(30, 25),
                 torch.tensor(0.75)]:
        out = ws_matmul(a, b, bias, alpha=0.5, beta=-2.0, config=SMALL)
        assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=-2.0), REL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_epilogue_activations_match_torchs(activation, dtype):
    """act(alpha * a @ b + beta * bias) from the epilogue: torch's activation of the float64
    reference, through whole tiles, split-K sums and the K = 0 fill; the activation is part
    of the cached plan (the same shape without it is plain)."""
    tol = REL_TOLERANCE[dtype]
    a, b, bias = torch.randn(45, 70, dtype=dtype), torch.randn(70, 38, dtype=dtype), torch.randn(38, dtype=dtype)
    reference = activations.apply(matmul_ref(a, b, bias, alpha=1.5, beta=0.5), activation)
    for config in (SMALL, dataclasses.replace(SMALL, split_k=3)):
        out = ws_matmul(a, b, bias, alpha=1.5, beta=0.5, config=config, activation=activation)
        assert_matches(out, reference, tol)
    assert_matches(ws_matmul(a, b, bias, alpha=1.5, beta=0.5, activation=activation), reference, tol)
    assert_matches(ws_matmul(a, b, bias, alpha=1.5, beta=0.5), matmul_ref(a, b, bias, alpha=1.5, beta=0.5), tol)
    empty_k = ws_matmul(a[:, :0], b[:0], bias, beta=0.5, activation=activation)
    torch.testing.assert_close(empty_k, activations.apply(0.5 * bias, activation).expand(45, 38))
    # Large magnitudes: the tanh form saturates without overflow or NaN.
    big = ws_matmul(100 * a, b, activation=activation, config=SMALL)
    assert_matches(big, activations.apply(matmul_ref(100 * a, b), activation), tol)


def test_an_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation must be one of"):
        ws_matmul(torch.randn(4, 4), torch.randn(4, 4), activation="tanh")


def test_cpu_bfloat16_is_right_despite_the_interpreters_bf16_dot():
    a, b = torch.randn(33, 40, dtype=torch.bfloat16), torch.randn(40, 21, dtype=torch.bfloat16)
    out = ws_matmul(a, b)
    assert out.dtype == torch.bfloat16
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
def test_swapped_operands_match_the_reference(a_t, b_t, split_k):
    """swap_ab launches C^T = B^T @ A^T: the same result for every layout, with split-K, a
    bias broadcast either way, batches, and tensor descriptors where the layout allows."""
    config = dataclasses.replace(SMALL, swap_ab=True, split_k=split_k)
    tol = REL_TOLERANCE[torch.float32]
    a, b = operand(5, 50, torch.float32, a_t), operand(50, 70, torch.float32, b_t)
    for bias in [torch.randn(70), torch.randn(5, 1), torch.randn(5, 70)]:
        out = ws_matmul(a, b, bias, alpha=0.5, beta=-2.0, config=config, num_programs=3)
        assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=-2.0), tol)
    a3, b3 = torch.randn(3, 9, 40), torch.randn(3, 40, 24)
    for use_tma in (False, True):
        out = ws_matmul(a3, b3, config=config, num_programs=4, use_tma=use_tma)
        assert_matches(out, matmul_ref(a3, b3), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
def test_swapped_tiles_give_the_unswapped_bits(a_t, b_t, dtype):
    """As on the GPU (wgmma), an element's bits depend on its K order alone, not on which
    operand a tile takes as A: the interpreter's dot adds products in K order for every
    element (numpy's fp32 matmul on OpenBLAS, on an AMD EPYC, gave the transposed problem
    other bits)."""
    a, b = operand(5, 70, dtype, a_t), operand(70, 40, dtype, b_t)
    unswapped = ws_matmul(a, b, config=SMALL, num_programs=3)
    swapped = ws_matmul(a, b, config=dataclasses.replace(SMALL, swap_ab=True), num_programs=3)
    assert torch.equal(swapped, unswapped)
    assert_matches(swapped, matmul_ref(a, b), REL_TOLERANCE[dtype])


@pytest.mark.parametrize("shape", [(5, 7), (1, 64, 64), (3, 70, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transposing_copy_kernel_is_exact(shape, dtype):
    """The tiled kernel behind TF32's K-major copies on a GPU, run by the interpreter: every
    element lands where copy_ puts it (ragged tiles, batches, 2-D views), nothing outside
    the destination is written."""
    *batch, rows, cols = shape
    src = torch.randn(*batch, cols, rows).to(dtype).mT  # contiguous along rows
    buffer = torch.full((*batch, rows, cols + 3), 7.0, dtype=dtype)
    dst = buffer[..., :cols]
    relayout.launch(interpreter.interpreted(relayout.relayout_kernel), dst, src)
    assert torch.equal(dst, src)
    assert (buffer[..., cols:] == 7).all(), "the copy wrote past the destination's rows"


# ---------------------------------------------------------------------------------------
# Counters not all zero at launch: nothing hangs, and the launch's status and tally show it
# ---------------------------------------------------------------------------------------


def launch_on_counters(a, b, config, set_counters, *, schedule=Schedule.WORK_STEALING,
                       num_programs=3, max_spins=None):
    """A checked launch of a @ b whose counters `set_counters` spoiled first; returns the
    output and what WorkQueue.problems finds in the counters after the launch."""
    plan = launch.plan_for(a, b, None, 1.0, 1.0, Knobs(config, 2, num_programs, schedule))
    plan = dataclasses.replace(plan, checked=True, max_spins=max_spins or plan.max_spins)
    counters = torch.zeros(plan.queue.numel, dtype=torch.int32)
    set_counters(counters, plan.queue)
    out = torch.full(plan.out_shape, float("nan"))
    a_arg, b_arg, _, partials = launch.operands(plan, a, b, None)
    launch.launch_kernel(plan, a_arg, b_arg, out, None, counters, partials, 1.0, 1.0)
    return out, plan.queue.problems(counters.tolist(), tally=plan.queue.num_units)


def test_clean_counters_show_no_problem():
    a, b = torch.randn(50, 40), torch.randn(40, 70)
    for config in (SMALL, dataclasses.replace(SMALL, split_k=3)):
        out, problems = launch_on_counters(a, b, config, lambda counters, queue: None)
        assert problems == [] and torch.isfinite(out).all()


def test_a_claim_counter_past_any_claim_is_flagged():
    a, b = torch.randn(50, 40), torch.randn(40, 70)

    def past_the_end(counters, queue):
        counters[0] = 10_000  # shard 0 hands out nothing, and no claim can return this

    out, problems = launch_on_counters(a, b, SMALL, past_the_end)
    assert scheduler.STATUS_NAMES[scheduler.STATUS_CLAIM_OUT_OF_RANGE] in problems
    assert any("work units were computed" in p for p in problems)
    assert torch.isnan(out).any()  # shard 0's tiles were never computed


def test_a_claim_counter_left_midway_is_caught_by_the_tally():
    """Set to 2: shard 0's first two units are skipped, its counter is reset too early and
    later claims compute units twice; the launch's own tally and counters show it."""
    a, b = torch.randn(50, 40), torch.randn(40, 70)

    def midway(counters, queue):
        counters[0] = 2

    _, problems = launch_on_counters(a, b, SMALL, midway)
    assert problems, "a spoiled counter went unnoticed"


def test_a_split_k_sum_never_waits_forever():
    """An arrival count that can never reach SPLIT_K (work stealing's sums wait for it):
    the sum gives up after max_spins polls, writes NaN rows and flags the status."""
    a, b = torch.randn(20, 90), torch.randn(90, 24)
    config = dataclasses.replace(SMALL, split_k=3)

    def never_arriving(counters, queue):
        counters[queue.arrivals_offset] = -100  # tile 0

    out, problems = launch_on_counters(a, b, config, never_arriving, max_spins=3)
    assert scheduler.STATUS_NAMES[scheduler.STATUS_WAIT_TIMED_OUT] in problems
    assert torch.isnan(out[:16, :16]).all(), "tile 0's rows should be NaN"
    assert_matches(out[16:], matmul_ref(a, b)[16:], REL_TOLERANCE[torch.float32])


def test_a_split_tail_sum_never_waits_forever():
    """The same with a split tail, whose split tiles alone have arrival counters: the first
    is the launch's last tile (3 x 3 tiles on the interpreter's 4 "SMs": 8 whole, 1 split)."""
    a, b = torch.randn(45, 90), torch.randn(90, 40)
    config = dataclasses.replace(SMALL, split_k=3, split_tail=True)

    def never_arriving(counters, queue):
        assert (queue.whole_tiles, queue.split_tiles) == (8, 1)
        counters[queue.arrivals_offset] = -100

    out, problems = launch_on_counters(a, b, config, never_arriving, max_spins=3)
    assert scheduler.STATUS_NAMES[scheduler.STATUS_WAIT_TIMED_OUT] in problems
    assert any(p.startswith("the arrival counter of tile 8 is") for p in problems), problems
    assert torch.isnan(out[32:, 32:]).all(), "tile 8's rows should be NaN"
    reference = matmul_ref(a, b)
    assert_matches(out[:32], reference[:32], REL_TOLERANCE[torch.float32])
    assert_matches(out[32:, :32], reference[32:, :32], REL_TOLERANCE[torch.float32])


def test_a_static_split_k_arrival_left_set_is_caught():
    """Under the static schedule a tile's last slice sums the partials: an arrival count
    left at SPLIT_K - 1 makes the first slice sum partials never written."""
    a, b = torch.randn(20, 90), torch.randn(90, 24)
    config = dataclasses.replace(SMALL, split_k=3)

    def left_set(counters, queue):
        counters[queue.arrivals_offset] = 2

    _, problems = launch_on_counters(a, b, config, left_set, schedule=Schedule.STATIC, num_programs=16)
    assert any("arrival counter of tile 0" in p for p in problems), problems


@pytest.mark.parametrize("triton_version,numpy_version,works", [
    ("3.6.0", "2.3.5", True), ("3.6.0", "2.4.0", False), ("3.7.0", "2.5.2", True)])
def test_interpreter_refuses_triton_and_numpy_that_disagree(triton_version, numpy_version, works):
    """Triton 3.6's interpreter cannot run with numpy 2.4 (a loop bound held as a
    one-element array): the first CPU launch says which versions to install instead of
    failing inside the kernel."""
    with mock.patch.object(triton, "__version__", triton_version), \
            mock.patch.object(interpreter.np, "__version__", numpy_version):
        if works:
            interpreter._check_numpy()
        else:
            with pytest.raises(RuntimeError, match=r"numpy<2\.4 or triton>=3\.7"):
                interpreter._check_numpy()

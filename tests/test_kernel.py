"""The kernel itself, run by Triton's interpreter on CPU tensors: numerics at ragged edges,
every layout, the scheduling guarantee and bitwise reproducibility."""

import dataclasses
import itertools

import pytest
import torch
from triton import knobs

from tritonblas_ops import device as devices
from tritonblas_ops import config as configs
from tritonblas_ops import counters, kernel, relayout
from tritonblas_ops.config import TileConfig, num_tiles, select_config
from tritonblas_ops.kernel import Schedule, counter_elements, launch, ws_matmul
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
def test_tensor_descriptor_path_matches_reference(m, n, k, a_t, b_t, dtype, made_by, monkeypatch):
    """Descriptors built on the host (eager launches) or by each program (traced ones)."""
    real_launch = kernel.launch
    monkeypatch.setattr(kernel, "launch", lambda *args, **kwargs: real_launch(
        *args, host_descriptors=made_by == "host", **kwargs))
    a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
    bias = torch.randn(n, dtype=dtype)
    out = ws_matmul(a, b, bias, alpha=0.5, beta=2.0, config=SMALL, use_tma=True)
    assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=2.0), REL_TOLERANCE[dtype])
    a3, b3 = torch.randn(3, m, k, dtype=dtype), torch.randn(3, k, n, dtype=dtype)
    out = ws_matmul(a3, b3, config=SMALL, num_programs=5, use_tma=True)
    assert_matches(out, matmul_ref(a3, b3), REL_TOLERANCE[dtype])


def test_plan_descriptors_rebase_onto_new_tensors():
    """A cached plan keeps its descriptors without tensors and rebases them per call: same
    layout, the new base, the kept template untouched."""
    a3 = torch.randn(2, 40, 24)
    made = kernel._host_descriptors(a3, torch.randn(2, 24, 56), torch.empty(2, 40, 56), SMALL)
    for descriptor in made:
        template = kernel._rebased(descriptor, None)
        other = torch.randn(2, 40, 24)
        rebased = kernel._rebased(template, other)
        assert rebased.base is other and template.base is None
        assert (rebased.shape, rebased.strides, rebased.block_shape, rebased.padding) == (
            descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.padding)


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
    counters = torch.zeros(counter_elements(2, num_tiles(m, n, 1, SMALL), 1), dtype=torch.int32)
    launch(a[None], b[None], out, None, 1.0, 1.0, counters,
           config=SMALL, num_shards=2, num_programs=3)
    assert_matches(out[0], matmul_ref(a, b), REL_TOLERANCE[torch.float32])
    border = torch.ones_like(buffer, dtype=torch.bool)
    border[:, 4 : 4 + m, 5 : 5 + n] = False
    assert (buffer[border] == sentinel).all(), "the kernel wrote outside the output window"


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("num_programs", [1, 3, 5, 16])
@pytest.mark.parametrize("num_shards", [1, 2, 6, 8])
def test_every_tile_computed_exactly_once(num_shards, num_programs, schedule, split_k):
    a, b = torch.randn(2, 50, 40), torch.randn(2, 40, 70)
    assert_every_unit_computed_once(a, b, dataclasses.replace(SMALL, split_k=split_k),
                                    num_shards=num_shards, num_programs=num_programs,
                                    schedule=schedule, tolerance=REL_TOLERANCE[torch.float32])


def test_launches_share_one_counter_buffer_left_at_zero():
    """Eager launches on one device (and on a GPU, one stream) share a counter buffer,
    zeroed when it is made or grown and left at zero by every launch, so none fills its own:
    work stealing over 3 shards, then split-K (more counters: the buffer grows), then 8
    shards with more programs than units for some shards."""
    cases = [(SMALL, 3, 5), (dataclasses.replace(SMALL, split_k=3), 2, 4), (SMALL, 8, 3)]
    for config, shards, programs in cases:
        a, b = torch.randn(37, 50), torch.randn(50, 29)
        out = ws_matmul(a, b, config=config, num_shards=shards, num_programs=programs)
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.float32])
        buffer = counters._eager[("cpu", None)]
        assert buffer.numel() >= counter_elements(shards, num_tiles(37, 29, 1, config), config.split_k)
        assert (buffer == 0).all(), (config, shards, programs)


def test_one_wave_launches_take_the_static_schedule(monkeypatch):
    """No more work units than programs: each program has one unit at most, nothing to
    steal, so no claims; more units than programs: work stealing. One wave of split-K keeps
    work stealing when the static schedule's last slice would sum more than
    LAST_SLICE_SUM_MAX_BYTES of partials alone."""
    schedules = []
    original = kernel.launch

    def spy(*args, **kwargs):
        schedules.append(kwargs["schedule"])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "launch", spy)
    a, b = torch.randn(40, 30), torch.randn(30, 50)  # 3 x 4 tiles of SMALL
    for programs in (None, 12, 16):  # None: the interpreter's 4 programs
        assert_matches(ws_matmul(a, b, config=SMALL, num_programs=programs), matmul_ref(a, b),
                       REL_TOLERANCE[torch.float32])
    a, b = torch.randn(40, 600), torch.randn(600, 50)  # one tile of each config below
    for split_k, block in ((3, 64), (16, 128)):  # 48 KB and 1 MB of partials
        config = TileConfig(block, block, 32, split_k=split_k)
        assert_matches(ws_matmul(a, b, config=config, num_programs=16), matmul_ref(a, b),
                       REL_TOLERANCE[torch.float32])
    assert schedules == [Schedule.WORK_STEALING, Schedule.STATIC, Schedule.STATIC,
                         Schedule.STATIC, Schedule.WORK_STEALING]


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


def test_cpu_bfloat16_is_right_despite_the_interpreters_bf16_dot():
    a, b = torch.randn(33, 40, dtype=torch.bfloat16), torch.randn(40, 21, dtype=torch.bfloat16)
    out = ws_matmul(a, b)
    assert out.dtype == torch.bfloat16
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


def test_num_xcds_from_arch():
    assert devices.num_xcds_for_arch("gfx942:sramecc+:xnack-", 304) == 8  # MI300X
    assert devices.num_xcds_for_arch("gfx942", 228) == 6  # MI300A
    assert devices.num_xcds_for_arch("gfx950", 256) == 8  # MI350
    assert devices.num_xcds_for_arch("gfx90a", 110) == 1  # MI250X GCD: no XCD sharding


def test_default_shards_follow_the_xcds_on_hip(monkeypatch):
    class MI300A:
        gcnArchName = "gfx942:sramecc+:xnack-"
        multi_processor_count = 228

    monkeypatch.delenv(devices.SHARDS_ENV, raising=False)
    monkeypatch.setattr(devices, "is_hip", lambda: True)
    monkeypatch.setattr(devices, "_properties", lambda index: MI300A)
    assert devices.default_num_shards(torch.device("cuda", 0)) == 6
    monkeypatch.setattr(devices, "is_hip", lambda: False)
    assert devices.default_num_shards(torch.device("cuda", 0)) == 1
    monkeypatch.setenv(devices.SHARDS_ENV, "4")
    assert devices.default_num_shards(torch.device("cuda", 0)) == 4
    monkeypatch.setenv(devices.SHARDS_ENV, "0")
    with pytest.raises(ValueError, match="TRITONBLAS_OPS_NUM_SHARDS must be a positive integer"):
        devices.default_num_shards(torch.device("cuda", 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_selector_splits_k_only_below_a_wave(dtype, monkeypatch):
    """The cost model (132 SMs, as the H200): shapes with a wave of tiles or more keep whole
    K; skinny and K-heavy ones are split, into slices no shorter than MIN_K_PER_SPLIT and no
    more than two waves of work units."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in [(8192, 8192, 8192), (4096, 14336, 4096), (3000, 5000, 2000), (1000, 1000, 1000)]:
        assert select_config(m, n, k, 1, dtype, gpu).split_k == 1, (m, n, k)
    for m, n, k in [(16, 4096, 4096), (1, 4096, 14336), (256, 512, 32768), (1024, 1024, 16384)]:
        config = select_config(m, n, k, 1, dtype, gpu)
        assert config.split_k > 1, (m, n, k)
        assert k // config.split_k >= configs.MIN_K_PER_SPLIT
        tiles = num_tiles(n, m, 1, config) if config.swap_ab else num_tiles(m, n, 1, config)
        assert tiles * config.split_k <= 2 * 132
        assert not select_config(m, n, k, 1, dtype, gpu, allow_split_k=False).split_k > 1
    assert select_config(16, 4096, 300, 1, dtype, gpu).split_k == 1  # K too short to split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_selector_swaps_operands_only_for_a_few_rows(dtype, monkeypatch):
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m in (1, 7, configs.SWAP_MAX_M):
        config = select_config(m, 14336, 4096, 1, dtype, gpu)
        assert config.swap_ab and config.block_n >= m, m
        assert not select_config(m, 14336, 4096, 1, dtype, gpu, allow_swap_ab=False).swap_ab
    assert not select_config(configs.SWAP_MAX_M + 1, 14336, 4096, 1, dtype, gpu).swap_ab
    assert not select_config(8, 8, 4096, 1, dtype, gpu).swap_ab  # N no wider than M


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


@pytest.mark.parametrize("transposed", [False, True])
def test_aligned_copy_pads_rows_or_columns_to_whole_lines(transposed):
    """The copies made for tensor descriptors: same values, the unit stride where asked for,
    rows (or columns) and batches starting on 128-byte line boundaries, more than the 16
    bytes descriptors need (the padding is never read: descriptors clip at the edges)."""
    for dtype, cols in [(torch.bfloat16, 777), (torch.float32, 13), (torch.float16, 8)]:
        t = torch.randn(2, cols, 5, dtype=dtype).mT if transposed else torch.randn(2, 5, cols, dtype=dtype)
        for fix, unit_dim in (("rows", 2), ("columns", 1)):
            copy = kernel._fixed(t, fix)
            assert torch.equal(copy, t)
            other = 3 - unit_dim
            assert copy.stride(unit_dim) == 1 and (copy.stride(other) * copy.element_size()) % 128 == 0
            assert (copy.stride(0) * copy.element_size()) % 128 == 0
            assert copy.stride(other) * copy.element_size() < t.shape[unit_dim] * t.element_size() + 128
            assert kernel._tma_compatible(copy, traced=False)
    assert kernel._operand_fix(torch.randn(1, 4, 6)[:, :, ::2], align=False) == "contiguous"
    assert kernel._operand_fix(torch.randn(1, 4, 7), align=False) == ""
    assert kernel._operand_fix(torch.randn(1, 4, 7), align=True) == "rows"


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
    relayout.launch(kernel._InterpretedKernel(relayout._relayout_kernel), dst, src)
    assert torch.equal(dst, src)
    assert (buffer[..., cols:] == 7).all(), "the copy wrote past the destination's rows"


def test_tf32_operands_are_copied_k_major():
    """TF32's wgmma reads K-major operands only: where copies pay, A gets K-contiguous rows
    and B K-contiguous columns; a layout that already has them is left alone."""
    a, b = torch.randn(1, 8, 16), torch.randn(1, 16, 8)  # row-major: A is K-major, B is not
    assert kernel._operand_fix(a, align=True, k_dim=2) == ""
    assert kernel._operand_fix(b, align=True, k_dim=1) == "columns"
    assert kernel._operand_fix(b.mT.contiguous().mT, align=True, k_dim=1) == ""
    assert kernel._operand_fix(a.mT.contiguous().mT, align=True, k_dim=2) == "rows"
    assert kernel._operand_fix(b, align=False, k_dim=1) == ""  # too small to pay: as it is


def test_launch_hooks_are_idle_only_when_none_or_an_empty_chain():
    """Cached calls skip Triton's launcher (and the metadata it builds for hooks) only when
    no launch hook would be called: Triton 3.6 always holds a HookChain, never None."""
    chain = knobs.HookChain()
    assert kernel._idle(None) and kernel._idle(chain)
    chain.add(print)
    assert not kernel._idle(chain)
    assert not kernel._idle(print)  # a hook set directly, as older Tritons took it
    assert kernel._idle(knobs.runtime.launch_enter_hook) == (
        knobs.runtime.launch_enter_hook is None or not knobs.runtime.launch_enter_hook.calls)

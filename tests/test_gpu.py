"""The kernel and ops on a real GPU: real sizes, bf16, both load paths, the scheduling
guarantee with truly concurrent programs, and counters across launches, streams and graphs.
Skipped on machines without a GPU; run on the H200 (benchmarks/RESULTS.md)."""

import dataclasses
import itertools

import pytest
import torch
import triton
from torch.library import opcheck
from triton import knobs

import tritonblas_ops  # noqa: F401
from tritonblas_ops import activations, budget, counters, fastpath, launch, relayout
from tritonblas_ops import device as devices
from tritonblas_ops.config import (FP32_INVARIANT_CONFIGS, HALF_INVARIANT_CONFIGS, HALF_INVARIANT_DECODE_CONFIGS, TileConfig,
                                  select_config)
from tritonblas_ops.launch import ws_matmul
from tritonblas_ops.plan import Knobs, Operand, OperandCopy, Schedule
from tritonblas_ops.testing import (
    REL_TOLERANCE,
    assert_every_unit_computed_once,
    assert_matches,
    matmul_ref,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_empty")]

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
}


@pytest.fixture
def precision(request):
    """Sets torch's fp32 matmul precision for fp32 cases, restoring it afterwards."""
    name = request.param
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32" if name == "tf32" else "ieee"
    yield name
    torch.backends.cuda.matmul.fp32_precision = previous


def operand(rows, cols, dtype, transposed):
    if transposed:
        return torch.randn(cols, rows, dtype=dtype, device="cuda").t()
    return torch.randn(rows, cols, dtype=dtype, device="cuda")


def tolerance(name):
    return REL_TOLERANCE["tf32" if name == "tf32" else DTYPES[name]]


@pytest.mark.parametrize("precision", list(DTYPES), indirect=True)
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("m,n,k", [(257, 129, 300), (3000, 5000, 2000), (4096, 4096, 4096)])
def test_layouts_and_dtypes(m, n, k, a_t, b_t, precision):
    dtype = DTYPES[precision]
    a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
    assert_matches(ws_matmul(a, b), matmul_ref(a, b), tolerance(precision))


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 1, 1), (15, 17, 33), (40, 50, 7), (128, 8192, 8192), (4864, 8192, 4160),
     (8192, 8192, 8192), (1000, 1000, 1000), (4095, 4097, 4093)],
)
def test_real_sizes_bf16(m, n, k, use_tma):
    a, b = operand(m, k, torch.bfloat16, False), operand(k, n, torch.bfloat16, False)
    if use_tma and not (k % 8 == 0 and n % 8 == 0):
        pytest.skip("tensor descriptors need 16-byte aligned rows")
    assert_matches(ws_matmul(a, b, use_tma=use_tma), matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_bf16_fp16(dtype):
    a, b = operand(1000, 700, dtype, False), operand(700, 1300, dtype, True)
    bias = torch.randn(1300, dtype=dtype, device="cuda")
    tol = REL_TOLERANCE[dtype]
    assert_matches(torch.ops.tritonblas.ws_mm(a, b), matmul_ref(a, b), tol)
    out = torch.ops.tritonblas.ws_addmm(bias, a, b, beta=0.5, alpha=2.0)
    assert_matches(out, matmul_ref(a, b, bias, alpha=2.0, beta=0.5), tol)
    a3 = torch.randn(6, 300, 200, dtype=dtype, device="cuda")
    b3 = torch.randn(6, 200, 500, dtype=dtype, device="cuda")
    assert_matches(torch.ops.tritonblas.ws_bmm(a3, b3), matmul_ref(a3, b3), tol)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("m,n,k", [(1000, 1300, 700), (4096, 4096, 4096), (16, 14336, 4096)])
def test_epilogue_activations_bf16(m, n, k, use_tma, activation):
    """act(a @ b + bias) from the epilogue at real sizes, through the chosen configs (split-K
    for few rows), against torch's activation of the float64 reference; and the ws_mm_act
    op with and without a bias, opcheck clean."""
    if use_tma and k % 8:
        pytest.skip("tensor descriptors need 16-byte aligned rows")
    a, b = operand(m, k, torch.bfloat16, False), operand(k, n, torch.bfloat16, True)
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    tol = REL_TOLERANCE[torch.bfloat16]
    reference = activations.apply(matmul_ref(a, b, bias), activation)
    assert_matches(ws_matmul(a, b, bias, use_tma=use_tma, activation=activation), reference, tol)
    assert_matches(torch.ops.tritonblas.ws_mm_act(a, b, bias, activation=activation), reference, tol)
    plain = torch.ops.tritonblas.ws_mm_act(a, b, None, activation=activation)
    assert_matches(plain, activations.apply(matmul_ref(a, b), activation), tol)
    if m == 1000 and not use_tma:
        opcheck(torch.ops.tritonblas.ws_mm_act.default, (a, b, bias), {"activation": activation})


@pytest.mark.parametrize("split_k,split_tail", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("num_programs", [1, 3, 132, 264])
@pytest.mark.parametrize("num_shards", [1, 2, 6, 8])
def test_every_tile_computed_exactly_once(num_shards, num_programs, schedule, split_k, split_tail):
    m, n, k, batches = 2000, 3000, 512, 2
    a = torch.randn(batches, m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(batches, k, n, dtype=torch.bfloat16, device="cuda")
    config = dataclasses.replace(select_config(m, n, k, batches, a.dtype, a.device), split_k=split_k,
                                 split_tail=split_tail)
    assert_every_unit_computed_once(a, b, config, num_shards=num_shards, num_programs=num_programs,
                                    schedule=schedule, tolerance=REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("m,n,k", [(16, 3072, 8192), (128, 8192, 8192), (256, 512, 32768),
                                   (1, 4096, 14336), (1000, 1000, 8000), (77, 333, 9999)])
def test_split_k_shapes_the_selector_splits(m, n, k):
    """The skinny and K-heavy shapes select_config splits: right, and bitwise equal run to
    run and whatever the grid (the slices are summed in slice order, whoever sums them)."""
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    config = select_config(m, n, k, 1, a.dtype, a.device)
    if config.split_k == 1:
        config = dataclasses.replace(config, split_k=3)  # unaligned K: split it anyway
    first = ws_matmul(a, b, config=config)
    assert_matches(first, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])
    for programs in (1, 7, 132):
        assert torch.equal(ws_matmul(a, b, config=config, num_programs=programs), first)
    for _ in range(10):
        assert torch.equal(ws_matmul(a, b, config=config), first)


@pytest.mark.parametrize("m,n,k", [(3072, 768, 8192), (1024, 2816, 4096), (2304, 1000, 4000)])
def test_split_tail_is_right_and_its_bits_ignore_grid_and_budget(m, n, k):
    """A split tail (the selector's for the first two; forced on a ragged shape): right,
    bitwise equal run to run, whatever the grid, under an SM budget and a live budget
    lowered mid-launch, and its whole tiles bitwise the unsplit launch's."""
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    config = select_config(m, n, k, 1, a.dtype, a.device)
    if not config.split_tail:
        config = TileConfig(128, 128, 64, num_warps=4, num_stages=4, split_k=3, split_tail=True)
    first = ws_matmul(a, b, config=config)
    assert_matches(first, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])
    for programs in (1, 7, 66, 132):
        assert torch.equal(ws_matmul(a, b, config=config, num_programs=programs), first), programs
    whole = ws_matmul(a, b, config=dataclasses.replace(config, split_k=1, split_tail=False))
    queue = launch.plan_for(a, b, None, 1.0, 1.0, Knobs(config)).queue
    assert 0 < queue.whole_tiles < queue.num_tiles
    tiles_m, tiles_n = -(-m // config.block_m), -(-n // config.block_n)
    for tile in range(queue.whole_tiles):  # the first tiles in the kernel's GROUP_M-swizzled order
        per_group = config.group_m * tiles_n
        first_m = tile // per_group * config.group_m
        group_rows = min(tiles_m - first_m, config.group_m)
        tile_m, tile_n = first_m + tile % per_group % group_rows, tile % per_group // group_rows
        block = (slice(tile_m * config.block_m, (tile_m + 1) * config.block_m),
                 slice(tile_n * config.block_n, (tile_n + 1) * config.block_n))
        assert torch.equal(first[block], whole[block]), tile
    side = torch.cuda.Stream()
    live = tritonblas_ops.LiveBudget()
    with live:
        outs = [ws_matmul(a, b, config=config) for _ in range(4)]
        live.lower(16, side)
        outs += [ws_matmul(a, b, config=config) for _ in range(2)]
        live.restore(side)
        torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)


@pytest.mark.parametrize("precision", list(DTYPES), indirect=True)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_decode_shapes_run_transposed(m, precision):
    """M <= 16 runs as C^T = B^T @ A^T (swap_ab): right with a bias, for both layouts of each
    operand and a ragged N, on the first launch and the cached ones, bitwise the same."""
    dtype = DTYPES[precision]
    assert select_config(m, 4000, 4096, 1, dtype, torch.device("cuda")).swap_ab
    for a_t, b_t in [(False, False), (True, True), (False, True)]:
        a, b = operand(m, 4096, dtype, a_t), operand(4096, 4000, dtype, b_t)
        bias = torch.randn(4000, dtype=dtype, device="cuda")
        outs = [torch.ops.tritonblas.ws_addmm(bias, a, b, beta=0.5) for _ in range(3)]
        assert_matches(outs[0], matmul_ref(a, b, bias, beta=0.5), tolerance(precision))
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), (a_t, b_t)


@pytest.mark.parametrize("size", [1000, 2048])
@pytest.mark.parametrize("precision", ["tf32"], indirect=True)
def test_tf32_launch_gives_the_kernel_k_major_operands(precision, size):
    """wgmma reads TF32 operands K-major only: a row-major B is copied into K-contiguous
    columns (on the first launch and the cached ones), A row-major is left as it is;
    1000^3 is under the 16-bit copy threshold, not TF32's."""
    launch.clear_plans()
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    out = ws_matmul(a, b)
    assert_matches(out, matmul_ref(a, b), tolerance(precision))
    (plan,) = launch.cached_plans()
    assert (plan.copy_a, plan.copy_b) == (OperandCopy.NONE, OperandCopy.COLUMNS)
    assert torch.equal(ws_matmul(a, b), out)


@pytest.mark.parametrize("shape", [(1000, 777), (3, 4096, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposing_copy_is_exact(shape, dtype):
    """The tiled kernel behind K-major and aligned-row copies of transposed operands."""
    *batch, rows, cols = shape
    src = torch.randn(*batch, cols, rows, dtype=dtype, device="cuda").mT
    dst = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    assert relayout.copy_into(dst, src) is dst
    assert torch.equal(dst, src)


@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
@pytest.mark.parametrize("m,n,k,batches", [(4095, 4097, 4093, 1), (2049, 1023, 777, 1), (1000, 1000, 1001, 3)])
def test_unaligned_operands_are_copied_aligned_for_descriptors(m, n, k, batches, a_t, b_t):
    """Rows not 16-byte aligned: where the GEMM is large enough, A and B are copied into
    padded rows and loaded through descriptors; C (unaligned too) is stored by pointers."""
    def make(rows, cols, transposed):
        t = torch.randn(batches, cols, rows, dtype=torch.bfloat16, device="cuda").mT if transposed else \
            torch.randn(batches, rows, cols, dtype=torch.bfloat16, device="cuda")
        return t if batches > 1 else t[0]

    a, b = make(m, k, a_t), make(k, n, b_t)
    plan = launch.plan_for(a, b, None, 1.0, 1.0)
    assert OperandCopy.ROWS in (plan.copy_a, plan.copy_b) and plan.use_tma
    for t, copy in ((a, plan.copy_a), (b, plan.copy_b)):  # copied as planned: line-aligned rows
        if copy is OperandCopy.ROWS:
            copied = launch.copy_operand(t, copy)
            assert Operand.of(copied, traced=False).aligned and (copied.stride(-2) * 2) % 128 == 0
    for _ in range(2):  # the first launch, then the cached one
        out = torch.ops.tritonblas.ws_bmm(a, b) if batches > 1 else torch.ops.tritonblas.ws_mm(a, b)
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.usefixtures("unchecked")
def test_cached_launch_matches_the_first_launch_and_reuses_its_plan():
    """The second call with a key launches Triton's compiled kernel directly: same bits, one
    plan per key (alignment is part of the key: an operand 2 bytes off its allocation gets
    its own, which copies it aligned), new tensors of the same layout read through the plan's descriptors, and no
    cached launch keeps a tensor of the call that made it alive."""
    launch.clear_plans()
    for offset in (0, 1):  # aligned, and 2 bytes off
        for _ in range(2):  # the second time new tensors meet the first time's plan
            base = torch.randn(4097 * 1024 + 1, dtype=torch.bfloat16, device="cuda")
            a = base[offset:offset + 4096 * 1024].view(4096, 1024)
            b = torch.randn(1024, 3000, dtype=torch.bfloat16, device="cuda")
            bias = torch.randn(3000, dtype=torch.bfloat16, device="cuda")
            ref = matmul_ref(a, b, bias, alpha=0.5, beta=2.0)
            outs = [ws_matmul(a, b, bias, alpha=0.5, beta=2.0) for _ in range(3)]
            assert_matches(outs[0], ref, REL_TOLERANCE[torch.bfloat16])
            assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert [plan.copy_a for plan in launch.cached_plans()] == [OperandCopy.NONE, OperandCopy.ROWS]
    kept = [arg.base if isinstance(arg, fastpath.DESCRIPTORS) else arg
            for cached in launch._cache.values() for arg in cached.launch.args]
    assert not any(isinstance(arg, torch.Tensor) for arg in kept)
    a = torch.randn(333, 1000, dtype=torch.float16, device="cuda")
    b = torch.randn(1000, 222, dtype=torch.float16, device="cuda")
    assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), torch.ops.tritonblas.ws_mm(a, b))
    column_major = a.t().contiguous().t(), b.t().contiguous().t()
    for _ in range(2):
        assert_matches(torch.ops.tritonblas.ws_mm(*column_major), matmul_ref(a, b), REL_TOLERANCE[torch.float16])


CACHED_CASES = {  # (M, N, K, A transposed, B transposed, bias, dtype)
    "tma_store": (3000, 4000, 1000, False, False, True, torch.bfloat16),
    "split_k": (256, 512, 32768, False, False, True, torch.bfloat16),
    "swap_ab": (5, 4000, 4096, False, True, True, torch.bfloat16),
    "pointer_loads": (333, 222, 999, False, False, False, torch.float16),  # 1998-byte rows
    "aligned_copies": (2049, 1023, 777, True, False, False, torch.bfloat16),
}


DIRECT_LAUNCH = fastpath.ENABLED and triton.__version__.startswith(fastpath.DIRECT_LAUNCH_TRITON)


def only_cached_launch():
    (cached,) = launch._cache.values()
    return cached.launch


def spy_on_direct_launch() -> list:
    """Counts the cached calls that take the cached launch's direct C launch."""
    cached = only_cached_launch()
    calls, direct = [], cached.direct
    assert direct is not None, (
        f"no direct launch: Triton {triton.__version__}'s launcher is not the shape "
        f"fastpath.DirectLaunch.build expects")

    def spy(*args):
        calls.append(args)
        return direct(*args)

    cached.direct = spy
    return calls


@pytest.mark.parametrize("case", list(CACHED_CASES))
@pytest.mark.usefixtures("unchecked")
def test_cached_calls_match_a_launch_through_tritons_binding(case):
    """Cached calls (the plan's kernel launched with the call's tensors) give bitwise what
    the uncached path gives (every decision made again, Triton's own argument binding) for
    every kind of launch, with new tensors on every call. On the Triton it was written for
    (3.6) every cached call takes the direct C launch; the last call passes the previous
    call's B again, whose descriptor (and likely C's: the allocator hands its block out
    again) is then the one encoded before."""
    m, n, k, a_t, b_t, has_bias, dtype = CACHED_CASES[case]
    launch.clear_plans()
    direct_calls = []
    for call in range(4):
        a = operand(m, k, dtype, a_t)
        if call < 3:  # the last call passes the previous call's B again
            b = operand(k, n, dtype, b_t)
        bias = torch.randn(n, dtype=dtype, device="cuda") if has_bias else None
        out = ws_matmul(a, b, bias, alpha=0.5, beta=2.0)
        if call == 0 and DIRECT_LAUNCH:
            direct_calls = spy_on_direct_launch()
        uncached = ws_matmul(a, b, bias, alpha=0.5, beta=2.0, num_shards=devices.default_num_shards(a.device))
        assert torch.equal(out, uncached), (case, call)
        assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=2.0), REL_TOLERANCE[dtype])
    assert len(direct_calls) == (3 if DIRECT_LAUNCH else 0)


@pytest.mark.usefixtures("unchecked")
def test_launch_hooks_see_cached_calls():
    """A profiler's launch hook (Triton's knobs) sends cached calls through Triton's own
    launcher, which calls it with the kernel's metadata; once removed, the direct launch
    comes back."""
    a = torch.randn(1000, 800, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(800, 600, dtype=torch.bfloat16, device="cuda")
    launch.clear_plans()
    first = ws_matmul(a, b)
    direct_calls = spy_on_direct_launch() if DIRECT_LAUNCH else []
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hooked = ws_matmul(a, b)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["ws_matmul_kernel"] and direct_calls == []
    assert torch.equal(hooked, first) and torch.equal(ws_matmul(a, b), first)
    assert len(direct_calls) == (1 if DIRECT_LAUNCH else 0)


def test_bitwise_identical_across_runs_and_schedules():
    a = torch.randn(3000, 4000, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4000, 5000, dtype=torch.bfloat16, device="cuda")
    first = ws_matmul(a, b)
    for _ in range(20):
        assert torch.equal(ws_matmul(a, b), first)
    for shards, programs, schedule in [(8, 132, Schedule.WORK_STEALING), (3, 50, Schedule.WORK_STEALING),
                                       (1, 7, Schedule.WORK_STEALING), (1, 132, Schedule.STATIC)]:
        again = ws_matmul(a, b, num_shards=shards, num_programs=programs, schedule=schedule)
        assert torch.equal(again, first), (shards, programs, schedule)


def test_back_to_back_launches_without_sync():
    pairs = [(torch.randn(512 + 64 * i, 768, device="cuda", dtype=torch.float16),
              torch.randn(768, 1024, device="cuda", dtype=torch.float16)) for i in range(8)]
    outs = [torch.ops.tritonblas.ws_mm(a, b) for _ in range(5) for a, b in pairs]
    for i, out in enumerate(outs):
        a, b = pairs[i % len(pairs)]
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.float16])


def test_two_streams_at_once():
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),
               torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)) for _ in streams]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(4):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(torch.ops.tritonblas.ws_mm(*inputs[i]))
    torch.cuda.synchronize()
    for i, results in enumerate(outs):
        ref = matmul_ref(*inputs[i])
        for out in results:
            assert_matches(out, ref, REL_TOLERANCE[torch.bfloat16])


def test_cuda_graph_capture_and_replay_with_new_inputs():
    a = torch.randn(1500, 1000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, 2500, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2500, device="cuda", dtype=torch.bfloat16)
    torch.ops.tritonblas.ws_addmm(bias, a, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.tritonblas.ws_addmm(bias, a, b)
    for _ in range(10):
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, matmul_ref(a, b, bias), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("slab", ["slices", "spent"])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (256, 512, 32768)], ids=["whole", "split_k"])
def test_two_graphs_replayed_at_once_on_two_streams(m, n, k, slab):
    """Every captured launch has counters of its own (a slice of the slab, or with the slab
    spent, zeros of its own in the graph), so two graphs replayed at the same time on two
    streams both stay right; shared counters would give each tile to one of them only."""
    pairs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
              torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    torch.ops.tritonblas.ws_mm(*pairs[0])  # compiles; makes the slab
    torch.cuda.synchronize()
    if slab == "spent":
        counters.spend_slab(torch.device("cuda", torch.cuda.current_device()))
    graphs, outs = [torch.cuda.CUDAGraph() for _ in pairs], []
    for graph, (a, b) in zip(graphs, pairs):
        with torch.cuda.graph(graph):
            outs.append(torch.ops.tritonblas.ws_mm(a, b))
    streams = [torch.cuda.Stream() for _ in pairs]
    refs = [matmul_ref(a, b) for a, b in pairs]
    for _ in range(10):
        for out in outs:
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, refs):
            assert_matches(out, ref, REL_TOLERANCE[torch.bfloat16])


def test_a_failed_call_leaves_later_calls_right():
    a = torch.randn(300, 200, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="inner dimensions differ"):
        torch.ops.tritonblas.ws_mm(a, torch.randn(300, 100, device="cuda", dtype=torch.float16))
    with pytest.raises(RuntimeError, match="must be on the same device"):
        torch.ops.tritonblas.ws_mm(a, torch.randn(200, 100, dtype=torch.float16))
    b = torch.randn(200, 100, device="cuda", dtype=torch.float16)
    assert_matches(torch.ops.tritonblas.ws_mm(a, b), matmul_ref(a, b), REL_TOLERANCE[torch.float16])


def test_offsets_past_int32():
    """A has more than 2**31 elements: its last rows sit past any int32 offset."""
    m, k, n = (2**31 // 4096) + 1000, 4096, 64
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = ws_matmul(a, b)
    for rows in (slice(0, 512), slice(m - 1500, m)):
        assert_matches(out[rows], matmul_ref(a[rows], b), REL_TOLERANCE[torch.bfloat16])
    del a


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_on_cuda(requires_grad):
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)

    opcheck(torch.ops.tritonblas.ws_mm, (t(64, 48), t(32, 48).mT))
    opcheck(torch.ops.tritonblas.ws_addmm, (t(32), t(48, 64).mT, t(32, 48).mT), {"beta": 0.5, "alpha": 2.0})
    opcheck(torch.ops.tritonblas.ws_bmm, (t(3, 64, 48), t(3, 48, 32)))


@pytest.mark.usefixtures("unchecked")
def test_the_applications_triton_allocator_is_left_alone():
    """Eager launches build their descriptors on the host and need no scratch memory: an
    allocator the application gave Triton stays set, whatever path a call takes."""
    from triton.runtime import _allocation

    def application_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    previous = _allocation._allocator.get()
    triton.set_allocator(application_allocator)
    try:
        a = torch.randn(1024, 768, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(768, 512, dtype=torch.bfloat16, device="cuda")
        launch.clear_plans()
        for _ in range(2):  # uncached, then cached
            assert_matches(torch.ops.tritonblas.ws_mm(a, b), matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])
        assert_matches(ws_matmul(a, b, use_tma=True, num_programs=7), matmul_ref(a, b),
                       REL_TOLERANCE[torch.bfloat16])
        assert _allocation._allocator.get() is application_allocator
    finally:
        triton.set_allocator(previous)


def test_compiled_explicit_op_makes_its_descriptors_in_the_programs():
    """torch.compile of a function calling ws_mm decomposes the op into its Triton kernel,
    whose programs make the descriptors (no data pointers while tracing); Inductor gives
    them scratch memory, with no allocator of ours set."""
    from torch._inductor.utils import run_and_get_code
    from triton.runtime import _allocation

    torch._dynamo.reset()
    triton.set_allocator(_allocation.NullAllocator())
    a = torch.randn(1024, 768, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(768, 512, dtype=torch.bfloat16, device="cuda")
    plan = launch.plan_for(a, b, None, 1.0, 1.0)
    assert plan.use_tma
    out, code = run_and_get_code(torch.compile(lambda x, y: torch.ops.tritonblas.ws_mm(x, y)), a, b)
    assert "ws_matmul_kernel" in "\n".join(code)
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"], indirect=True)
@pytest.mark.parametrize("m,n,k", [(16, 4096, 14336), (1000, 520, 1032), (8, 1024, 8192)])
def test_bits_depend_on_the_k_chunks_alone(m, n, k, precision):
    """Batch-invariant mode's premise: an element's bits do not change with the tile's rows,
    columns, warps, stages, K step, load path or transposition (wgmma adds a K step's
    products alike), only with how K is cut into chunks. Every forced tile, one chunk, gives
    the reference tile's bits; cuBLAS need not."""
    fp32 = precision == "tf32"
    dtype = DTYPES[precision]
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    b = torch.randn(k, n, dtype=dtype, device="cuda")
    steps = (32, 64) if fp32 else (64, 128)
    reference = ws_matmul(a, b, config=TileConfig(128, 128, steps[0], num_warps=4, num_stages=4))
    assert_matches(reference, matmul_ref(a, b), tolerance(precision))
    tiles = [TileConfig(bm, bn, bk, num_warps=w, num_stages=3, swap_ab=swap)
             for bm, bn, w in ((128, 256, 8), (64, 128, 4), (64, 32, 4), (128, 16, 4), (128, 32, 4))
             for bk in steps for swap in (False, True) if not (bn == 256 and bk == steps[1])]
    tiles += FP32_INVARIANT_CONFIGS if fp32 else HALF_INVARIANT_CONFIGS + tuple(c for c, _ in HALF_INVARIANT_DECODE_CONFIGS)
    for config, use_tma in itertools.product(tiles, (True, False)):
        assert torch.equal(ws_matmul(a, b, config=config, use_tma=use_tma), reference), (config, use_tma)


@pytest.fixture
def batch_invariant():
    before = tritonblas_ops.is_batch_invariant()
    launch.clear_plans()
    tritonblas_ops.batch_invariant(True)
    yield
    tritonblas_ops.batch_invariant(before)
    launch.clear_plans()


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"], indirect=True)
@pytest.mark.parametrize("name", ["ws_mm", "ws_addmm", "ws_bmm"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (512, 32768), (768, 8192)])
def test_batch_invariant_rows_from_decode_to_prefill(name, n, k, precision, batch_invariant):
    """Every row of ws_mm(a[:m], b) bitwise equal to that row of ws_mm(a, b), m from 1 to
    8192: tiles from the transposed 64x16 (16-bit decode) and 64x32 to 128x256 as M grows
    (K steps of 256 to 64), and where a decode unit would stream much of B (N = 1000 with
    K = 14336, N = 512 with K = 32768, N = 768 with K = 8192) K in chunks that are split-K
    units for few rows, summed inside each tile for many, and for 3072 and 4096 rows of
    N = 768 a split tail of both."""
    dtype = DTYPES[precision]
    batches = 2 if name == "ws_bmm" else 1
    a = torch.randn(batches, 8192, k, dtype=dtype, device="cuda")
    b = torch.randn(batches, k, n, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")

    def call(rows):
        if name == "ws_mm":
            return torch.ops.tritonblas.ws_mm(a[0, :rows], b[0])
        if name == "ws_addmm":
            return torch.ops.tritonblas.ws_addmm(bias, a[0, :rows], b[0], beta=0.5, alpha=2.0)
        return torch.ops.tritonblas.ws_bmm(a[:, :rows], b)

    full = call(8192)
    if name == "ws_addmm":
        reference = matmul_ref(a[0, :64], b[0], bias, alpha=2.0, beta=0.5)
    else:
        reference = matmul_ref(a[..., :64, :], b if name == "ws_bmm" else b[0])
    assert_matches(full[..., :64, :], reference.reshape(full[..., :64, :].shape), tolerance(precision))
    for rows in (1, 2, 7, 16, 17, 64, 100, 128, 1000, 3072, 4096):
        assert torch.equal(call(rows), full[..., :rows, :]), rows
    if n == 768:
        assert launch.plan_for(a[0, :3072], b[0], None, 1.0, 1.0).config.split_tail
    if n in (4096, 1000):  # 16-bit decode on the transposed tile
        assert launch.plan_for(a[0, :16], b[0], None, 1.0, 1.0).swap_ab == (precision != "tf32")


@pytest.mark.usefixtures("batch_invariant")
def test_batch_invariant_compiled_matches_eager_rows():
    """Routed under torch.compile, batch-invariant: a decode batch's rows are the bits eager
    gives the same rows inside a prefill batch."""
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
    full = torch.ops.tritonblas.ws_mm(x, w.t())
    compiled = torch.compile(lambda x: torch.nn.functional.linear(x, w))
    for rows in (1, 16, 300):
        assert torch.equal(compiled(x[:rows]), full[:rows]), rows


@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (256, 512, 32768), (16, 14336, 4096)])
def test_sm_budget_and_carveout_change_the_grid_not_the_bits(m, n, k):
    """Under sm_budget(n) and torch's SM carve-out the launch runs fewer programs (every
    unit still once: checked launches) and gives the unbudgeted result's bits."""
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    launch.clear_plans()
    free = torch.ops.tritonblas.ws_mm(a, b)
    with tritonblas_ops.sm_budget(66):
        assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), free)
    torch._C._set_sm_carveout_experimental(16)
    try:
        assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), free)
    finally:
        torch._C._set_sm_carveout_experimental(None)
    units = devices.num_compute_units(a.device)
    grids = {plan.grid for plan in launch.cached_plans()}
    planned = min(units, max(grids))
    assert grids == {planned, min(planned, 66), min(planned, units - 16)}
    assert_matches(free, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.usefixtures("unchecked")  # checked launches synchronize around each launch
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (256, 512, 32768), (16, 14336, 4096)])
def test_live_budget_lowered_mid_launch_keeps_the_bits(m, n, k):
    """A LiveBudget lowered from another stream while GEMMs run (a stream write, no SM):
    programs leave mid-launch, the rest finish; every result is the unbudgeted one's bits,
    and launches after it (counters reset by departures too) are right."""
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    free = torch.ops.tritonblas.ws_mm(a, b)
    side = torch.cuda.Stream()
    live = tritonblas_ops.LiveBudget()
    with live:
        for programs in (1, 16, 100, 131):
            outs = [torch.ops.tritonblas.ws_mm(a, b) for _ in range(4)]  # queued: runs for a while
            live.lower(programs, side)
            outs += [torch.ops.tritonblas.ws_mm(a, b) for _ in range(2)]  # start under the budget
            live.restore(side)
            torch.cuda.synchronize()
            for out in outs:
                assert torch.equal(out, free), programs
    assert any(p.live_budget is live.word for p in launch.cached_plans())
    tritonblas_ops.set_checked(True)  # the counters read back: all zero before and after
    assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), free)
    assert_matches(free, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


def test_live_budget_writes_in_stream_order_with_the_drivers_stream_write():
    """lower() and restore() land in their stream's order (behind a long GEMM on it) through
    the driver's stream write, which this driver accepts; captured into a CUDA graph (a
    copy there), the write happens at each replay."""
    live = tritonblas_ops.LiveBudget()
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(side):
        torch.mm(a, a)
        live.lower(5, side)
        assert live.word.item() == 5
        torch.mm(a, a)
        live.restore(side)
        assert live.word.item() == budget.UNLIMITED
    assert budget._driver_stream_write() is not None and not budget._stream_write_refused.is_set()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        live.lower(7)
    assert live.word.item() == budget.UNLIMITED
    graph.replay()
    assert live.word.item() == 7
    assert not budget._stream_write_refused.is_set()


@pytest.mark.usefixtures("unchecked")
def test_live_budget_read_by_a_captured_graph_when_it_replays():
    """A launch captured under a LiveBudget reads the word at each replay: lowered before
    a replay (programs leave at once) or during it, the bits are the unbudgeted ones."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    free = torch.ops.tritonblas.ws_mm(a, b)
    live = tritonblas_ops.LiveBudget()
    side = torch.cuda.Stream()
    with live:
        torch.ops.tritonblas.ws_mm(a, b)  # compile the budgeted kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.tritonblas.ws_mm(a, b)
        assert any(p.live_budget is live.word for p in launch.cached_plans())
        for programs in (1, 64):
            live.lower(programs)
            out.fill_(float("nan"))
            graph.replay()
            live.restore()
            torch.cuda.synchronize()
            assert torch.equal(out, free), programs
            out.fill_(float("nan"))
            graph.replay()
            live.lower(programs, side)  # while the replay runs
            torch.cuda.synchronize()
            live.restore(side)
            torch.cuda.synchronize()
            assert torch.equal(out, free), programs

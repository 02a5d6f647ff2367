"""The warp-specialized kernel (warp_specialized_kernel.py) on a Hopper GPU: the Triton
kernel's bits for every launch it takes, whatever the tile, shape, layout, epilogue, grid
or live budget, with every output written (outputs start as NaN) and the counters drained
after every launch (the session's launches are checked: conftest.py). Skipped without an
sm_90 GPU. Run first:

    python -m pytest tests/test_warp_specialized.py -x -q
"""

import contextlib
import dataclasses

import pytest
import torch
import triton

import tritonblas_ops
from tritonblas_ops import counters, fastpath, grouped, launch, settings
from tritonblas_ops.config import HALF_CONFIGS
from tritonblas_ops.plan import Kernel, Knobs
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref

from grouped_cases import group_sizes, offsets, operands, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the warp-specialized kernel runs on Hopper (sm_90) only"),
    pytest.mark.usefixtures("poison_empty"),
]

WIDE, SQUARE = HALF_CONFIGS[0], HALF_CONFIGS[1]  # 128x256x64 and 128x128x64


@contextlib.contextmanager
def warp_specializing(enabled: bool):
    before = settings.update(warp_specialize=enabled)
    try:
        yield
    finally:
        settings.restore(before)


def run(a, b, bias=None, *, alpha=1.0, beta=1.0, activation="none", knobs=Knobs(), warp_specialized: bool):
    """The launch's output, by the kernel asked for (the plan must name it)."""
    with warp_specializing(warp_specialized):
        the_plan = launch.plan_for(a, b, bias, alpha, beta, knobs, activation=activation)
    assert (the_plan.kernel is Kernel.WARP_SPECIALIZED) == warp_specialized, the_plan
    return launch.execute(the_plan, a, b, bias, alpha, beta)[0]


def assert_same_bits(a, b, bias=None, **kwargs):
    """Both kernels give the same bits, and those are right."""
    triton_out = run(a, b, bias, warp_specialized=False, **kwargs)
    warp_specialized = run(a, b, bias, warp_specialized=True, **kwargs)
    assert torch.equal(warp_specialized, triton_out)
    return warp_specialized


def operand(rows, cols, dtype, transposed=False, batches=None):
    """(rows, cols), or (batches, rows, cols); transposed: stored the other way round."""
    lead = (batches,) if batches else ()
    if transposed:
        return torch.randn(*lead, cols, rows, dtype=dtype, device="cuda").mT
    return torch.randn(*lead, rows, cols, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [WIDE, SQUARE], ids=["128x256", "128x128"])
@pytest.mark.parametrize("m,n,k,programs", [(4096, 4096, 4096, None), (3000, 5000, 2000, None),
                                            (1000, 1304, 776, 16), (129, 264, 72, 2)])
def test_the_triton_kernels_bits(m, n, k, programs, config, dtype):
    """Whole and ragged tiles at M, N and K (TMA clips them), many tiles per program."""
    a, b = operand(m, k, dtype), operand(k, n, dtype)
    out = assert_same_bits(a, b, knobs=Knobs(config, num_programs=programs))
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[dtype])


@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("m,n,k,chunks,programs", [(4096, 1000, 4096, 4, None), (3000, 1304, 2000, 3, None),
                                                   (129, 264, 776, 2, 2)])
def test_k_chunks_the_triton_kernels_bits(m, n, k, chunks, programs, b_t):
    """Batch-invariant launches' K chunks on the 128x128 tile, summed in turn by the MMA
    warps while the loader streams on: the Triton kernel's bits (a pipeline per chunk)."""
    a, b = operand(m, k, torch.bfloat16), operand(k, n, torch.bfloat16, transposed=b_t)
    config = dataclasses.replace(SQUARE, num_warps=8, k_chunks=chunks)
    out = assert_same_bits(a, b, knobs=Knobs(config, num_programs=programs))
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("a_t,b_t", [(False, True), (True, False), (True, True)])
def test_operands_either_way_round(a_t, b_t):
    """B K-major (a weight's (N, K) storage), A column-major: read transposed by wgmma."""
    a, b = operand(3000, 2000, torch.bfloat16, a_t), operand(2000, 5000, torch.bfloat16, b_t)
    out = assert_same_bits(a, b)
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("b_t", [False, True])
def test_batched_operands(b_t):
    """(B, M, K) @ (B, K, N): one queue of every batch's tiles, descriptors of one batch's box."""
    a, b = operand(1000, 1024, torch.bfloat16, batches=5), operand(1024, 776, torch.bfloat16, b_t, batches=5)
    out = assert_same_bits(a, b, knobs=Knobs(num_programs=24))
    assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_shape", [None, (5000,), (3000, 1), (3000, 5000)])
def test_bias_and_activation_epilogues(bias_shape, activation):
    """act(alpha * A @ B + beta * bias), the bias broadcast or whole: the Triton epilogue's bits."""
    a, b = operand(3000, 2000, torch.bfloat16), operand(2000, 5000, torch.bfloat16, transposed=True)
    bias = torch.randn(bias_shape, dtype=torch.bfloat16, device="cuda") if bias_shape else None
    assert_same_bits(a, b, bias, alpha=0.75, beta=1.5, activation=activation)


@pytest.mark.parametrize("activation", ["gate_silu", "gate_gelu", "gate_d_gelu", "gate_d_gelu_tanh",
                                        "gate_d_silu"])
def test_gated_epilogues(activation):
    """act(gate) * alpha * A @ B, the gate passed as the bias (a GLU, an activation's backward)."""
    a, b = operand(3000, 2000, torch.bfloat16), operand(2000, 5000, torch.bfloat16)
    gate = torch.randn(3000, 5000, dtype=torch.bfloat16, device="cuda")
    assert_same_bits(a, b, gate, alpha=1.25, activation=activation)


@pytest.mark.parametrize("epilogue", ["none", "gate_silu", "gate_d_gelu"])
@pytest.mark.parametrize("config", [WIDE, SQUARE], ids=["128x256", "128x128"])
@pytest.mark.parametrize("m,n,k,programs", [(4096, 6144, 2048, None), (3000, 5000, 2000, 7),
                                            (1000, 1304, 64, 16), (1000, 1304, 128, 3), (129, 264, 72, 2)])
def test_a_whole_bias_read_ahead(m, n, k, programs, config, epilogue):
    """A whole (M, N) bias (a residual; a gate; an activation's pre-activation), rows of a
    wider tensor, read ahead into C's buffers by the loader: the Triton kernel's bits (its
    epilogue loads the bias itself), right against float64, for ragged tiles, many tiles
    per program (the buffers handed back and forth every tile) and K of 1 and 2 K steps
    (the hand-back at the tile's first or last step)."""
    a, b = operand(m, k, torch.bfloat16), operand(k, n, torch.bfloat16)
    bias = torch.randn(m, n + 8, dtype=torch.bfloat16, device="cuda")[:, :n]
    knobs = Knobs(config, num_programs=programs)
    with warp_specializing(True):
        the_plan = launch.plan_for(a, b, bias, 1.0, 1.0, knobs, activation=epilogue)
    assert the_plan.kernel is Kernel.WARP_SPECIALIZED and the_plan.prefetch_bias
    out = assert_same_bits(a, b, bias, activation=epilogue, knobs=knobs)
    if epilogue == "none":
        assert_matches(out, matmul_ref(a, b, bias), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_counters_drained_after_every_launch(shards):
    """Checked launches (the session's) compare the tally with the tiles; unchecked ones too
    must leave the stream's counter buffer all zero, launch after launch."""
    a, b = operand(4096, 2048, torch.bfloat16), operand(2048, 4096, torch.bfloat16)
    knobs = Knobs(num_shards=shards, num_programs=100)
    first = assert_same_bits(a, b, knobs=knobs)
    tritonblas_ops.set_checked(False)
    try:
        for _ in range(3):
            assert torch.equal(run(a, b, knobs=knobs, warp_specialized=True), first)
        torch.cuda.synchronize()
        buffer = counters.zeroed(1, a.device)
        assert not buffer.any(), buffer.nonzero()[:8].tolist()
    finally:
        tritonblas_ops.set_checked(True)


def test_the_ops_run_it_by_default():
    """torch.ops.tritonblas.ws_mm and ws_addmm (the cached plans) take it unless the setting
    is off, with the Triton kernel's bits."""
    a, b = operand(4096, 4096, torch.bfloat16), operand(4096, 4096, torch.bfloat16, transposed=True)
    bias = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    launch.clear_plans()
    with warp_specializing(False):
        plain = torch.ops.tritonblas.ws_mm(a, b), torch.ops.tritonblas.ws_addmm(bias, a, b)
    assert settings.RoutingSettings().warp_specialize
    with warp_specializing(settings.RoutingSettings().warp_specialize):
        for _ in range(3):  # the first call plans, the others reuse the plan
            assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), plain[0])
            assert torch.equal(torch.ops.tritonblas.ws_addmm(bias, a, b), plain[1])
    assert {p.kernel for p in launch.cached_plans()} == {Kernel.TRITON, Kernel.WARP_SPECIALIZED}


@pytest.mark.usefixtures("unchecked")  # a checked launch is never a cached fast launch
@pytest.mark.parametrize("epilogue", ["bias", "gelu", "residual"])
def test_cached_fast_launches_on_new_tensors(epilogue):
    """The cached launch (fastpath.CompiledLaunch; Triton 3.6's C launcher directly where it
    can) puts each call's tensors under the kept Gluon descriptors: calls on fresh operands
    (and a fresh residual, read ahead through its own descriptor), more of them than the
    descriptors it keeps encoded per operand, each the Triton kernel's bits; and a weight
    reused at one address."""
    b = operand(2048, 6144, torch.bfloat16)
    launch.clear_plans()
    outs, inputs = [], []
    with warp_specializing(True):
        for _ in range(fastpath.ENCODED_PER_SLOT + 3):
            a = operand(4096, 2048, torch.bfloat16)
            if epilogue == "residual" or not inputs:
                bias = torch.randn(*((4096,) if epilogue == "residual" else ()), 6144, dtype=torch.bfloat16,
                                   device="cuda")
            inputs.append((a, bias))
            outs.append(torch.ops.tritonblas.ws_addmm(bias, a, b) if epilogue == "bias" else
                        torch.ops.tritonblas.ws_mm_act(a, b, bias, activation="gelu" if epilogue == "gelu" else "none"))
    cached = list(launch._cache.values())
    assert len(cached) == 1 and cached[0].plan.kernel is Kernel.WARP_SPECIALIZED
    assert cached[0].plan.prefetch_bias is (epilogue == "residual")
    assert (cached[0].launch is not None) == fastpath.ENABLED
    if fastpath.ENABLED and triton.__version__.startswith(fastpath.DIRECT_LAUNCH_TRITON):
        assert cached[0].launch.direct is not None
    for (a, bias), out in zip(inputs, outs):
        activation = "gelu" if epilogue == "gelu" else "none"
        assert torch.equal(out, run(a, b, bias, activation=activation, warp_specialized=False))


@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (3000, 5000, 2000)])
def test_fewer_programs_same_bits(m, n, k):
    """sm_budget caps the grid: the remaining programs take every tile, the same bits."""
    a, b = operand(m, k, torch.bfloat16), operand(k, n, torch.bfloat16)
    launch.clear_plans()
    with warp_specializing(True):
        free = torch.ops.tritonblas.ws_mm(a, b)
        for programs in (1, 7, 66):
            with tritonblas_ops.sm_budget(programs):
                assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), free), programs
    assert all(p.kernel is Kernel.WARP_SPECIALIZED for p in launch.cached_plans())
    assert torch.equal(run(a, b, warp_specialized=False), free)


@pytest.mark.usefixtures("unchecked")  # checked launches synchronize around each launch
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (4096, 14336, 4096)])
def test_live_budget_lowered_mid_launch_keeps_the_bits(m, n, k):
    """A LiveBudget lowered from another stream while launches run: programs leave between
    tiles (their loader adds departures), the rest finish; the bits are the unbudgeted
    Triton kernel's, and the launches after it (counters reset by departures) are right."""
    a, b = operand(m, k, torch.bfloat16), operand(k, n, torch.bfloat16)
    free = run(a, b, warp_specialized=False)
    side = torch.cuda.Stream()
    live = tritonblas_ops.LiveBudget()
    launch.clear_plans()
    with warp_specializing(True), live:
        for programs in (1, 16, 100, 131):
            outs = [torch.ops.tritonblas.ws_mm(a, b) for _ in range(4)]  # queued: runs for a while
            live.lower(programs, side)
            outs += [torch.ops.tritonblas.ws_mm(a, b) for _ in range(2)]  # start under the budget
            live.restore(side)
            torch.cuda.synchronize()
            for out in outs:
                assert torch.equal(out, free), programs
        assert all(p.kernel is Kernel.WARP_SPECIALIZED and p.live_budget is live.word
                   for p in launch.cached_plans())
        tritonblas_ops.set_checked(True)  # the counters read back: all zero before and after
        assert torch.equal(torch.ops.tritonblas.ws_mm(a, b), free)


def test_cuda_graph_capture_and_replay_with_new_inputs():
    a, b = operand(1500, 1000, torch.bfloat16), operand(1000, 2600, torch.bfloat16)
    bias = torch.randn(2600, device="cuda", dtype=torch.bfloat16)
    with warp_specializing(True), tritonblas_ops.sm_budget(8):  # several tiles per program
        torch.ops.tritonblas.ws_addmm(bias, a, b)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.tritonblas.ws_addmm(bias, a, b)
        for _ in range(5):
            a.copy_(torch.randn_like(a))
            b.copy_(torch.randn_like(b))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, run(a, b, bias, warp_specialized=False))


@pytest.mark.parametrize("tile", [WIDE, SQUARE])
@pytest.mark.parametrize("groups,m,n", [(8, 1024, 1408), (64, 512, 768), (128, 256, 2048)])
def test_groups_along_k_bitwise_the_grouped_triton_kernels(tile, groups, m, n):
    """The MoE weight gradient (groups along K: x^T column-major, dOut row-major) on the
    warp-specialized kernel: each group's K steps from its begin, the last partial step's
    rows past its end zeroed, so bitwise the grouped Triton kernel's result (whose per-tile
    descriptors clip there); right against float64, empty groups' tiles zeros, each tile
    claimed once, the same bits whatever the grid."""
    generator = torch.Generator().manual_seed(groups)
    sizes = group_sizes(8192, groups, generator)
    sizes[0] = 0
    sizes[-1] += 37  # no group a multiple of the K step by design
    a, b, offs = operands("k", sizes, m, n, 0, torch.bfloat16, "cuda", generator)
    a = a.T.contiguous().T
    c = torch.empty(grouped.out_shape(a, b, offs), dtype=a.dtype, device="cuda")
    plan = grouped.plan_grouped(a, b, c, groups, config=tile)
    assert plan.kernel is Kernel.WARP_SPECIALIZED, plan
    counts = torch.zeros(plan.queue.num_tiles, dtype=torch.int32, device="cuda")
    out = grouped.grouped_mm(a, b, offs, unit_counts=counts, config=tile)
    units = grouped.num_units(plan, offs.tolist())
    assert (counts[:units] == 1).all() and (counts[units:] == 0).all()
    assert_matches(out, reference(a, b, offs), REL_TOLERANCE[torch.bfloat16])
    assert (out[0] == 0).all()  # the empty group
    with warp_specializing(False):
        assert torch.equal(out, grouped.grouped_mm(a, b, offs, config=tile))
    assert torch.equal(out, grouped.grouped_mm(a, b, offs, config=tile, num_programs=7))


def test_groups_along_k_in_a_cuda_graph_read_offs_when_replayed():
    generator = torch.Generator().manual_seed(3)
    a, b, offs = operands("k", group_sizes(4096, 16, generator), 512, 1024, 0, torch.bfloat16, "cuda", generator)
    a = a.T.contiguous().T
    tritonblas_ops.set_checked(False)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
        offs.copy_(offsets(group_sizes(4096, 16, generator)).cuda())
        graph.replay()
    finally:
        tritonblas_ops.set_checked(True)
    assert_matches(captured, reference(a, b, offs), REL_TOLERANCE[torch.bfloat16])

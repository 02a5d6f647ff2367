"""Reliability (issue 6): concurrency, CUDA graphs, huge and hostile inputs, numerics like
torch.mm, determinism, fuzzing and leaks.

CPU tests run the real kernel through Triton's interpreter, so their shapes stay small. The
`gpu` tests check the same properties at real sizes; run them on the H200 from the
repository root (the contention test imports benchmarks/sm_hog.py):
    python -m pytest tests/test_reliability.py -m gpu
What test_kernel.py, test_ops.py and test_gpu.py already cover is not repeated here.
"""

import contextlib
import copy
import dataclasses
import gc
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import tritonblas_ops  # registers the ops; routing is on from here
from tritonblas_ops import device as devices
from tritonblas_ops import interpreter, launch
from tritonblas_ops.config import TileConfig
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.plan import Knobs, Schedule, tf32_enabled
from tritonblas_ops.launch import ws_matmul
from concurrency import frequent_thread_switches, run_in_threads
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_magnitude, matmul_ref, rel_error

ops = torch.ops.tritonblas
FP32 = REL_TOLERANCE[torch.float32]
SMALL = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
NAN, INF = float("nan"), float("inf")


def randn(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def tolerance(dtype) -> float:
    if dtype == torch.float32 and torch.cuda.is_available() and tf32_enabled():
        return REL_TOLERANCE["tf32"]
    return REL_TOLERANCE[dtype]


def track_interpreter_overlap(monkeypatch, hold_s: float) -> dict:
    """Counts interpreted launches in flight at once (state["max"]). Triton's interpreter keeps
    the grid position and its patched `tl` functions in process-wide state, so two launches
    at once corrupt each other. Each launch is held `hold_s` longer to widen the window."""
    from triton.runtime.interpreter import GridExecutor

    state = {"active": 0, "max": 0}
    guard = threading.Lock()
    original = GridExecutor.__call__

    def tracked(self, *args, **kwargs):
        with guard:
            state["active"] += 1
            state["max"] = max(state["max"], state["active"])
        try:
            time.sleep(hold_s)
            return original(self, *args, **kwargs)
        finally:
            with guard:
                state["active"] -= 1

    monkeypatch.setattr(GridExecutor, "__call__", tracked)
    return state


def thread_cases(device, dtypes, scale: int):
    """(op name, args, kwargs, float64 reference, tolerance) per dtype, cycling through the
    ops. Sizes are multiplied by `scale`; at 20, mm's rows are 16-byte aligned (descriptors
    on a GPU) and the other ops' are not (pointer loads)."""

    def t(*shape, dtype):
        *batch, rows, cols = shape
        return randn(*batch, rows * scale, cols * scale, dtype=dtype, device=device)

    cases = []
    for i, dtype in enumerate(dtypes):
        if i % 3 == 0:
            a, b = t(19, 24, dtype=dtype), t(24, 16, dtype=dtype)
            case = ("ws_mm", (a, b), {}, matmul_ref(a, b))
        elif i % 3 == 1:
            a, b = t(17, 23, dtype=dtype).mT, t(17, 13, dtype=dtype)  # a is column-major
            bias = randn(13 * scale, dtype=dtype, device=device)
            case = ("ws_addmm", (bias, a, b), {"beta": 0.5, "alpha": 2.0},
                    matmul_ref(a, b, bias, alpha=2.0, beta=0.5))
        else:
            a, b = t(3, 11, 21, dtype=dtype), t(3, 21, 9, dtype=dtype)
            case = ("ws_bmm", (a, b), {}, matmul_ref(a, b))
        cases.append(case + (tolerance(dtype),))
    return cases


# =======================================================================================
# 1. Concurrency
# =======================================================================================


@pytest.mark.usefixtures("poison_empty")
def test_cpu_threads_get_right_results_one_launch_at_a_time(monkeypatch):
    interpreter.interpreted(ws_matmul_kernel)  # built before the threads start: the cold start is below
    overlap = track_interpreter_overlap(monkeypatch, hold_s=0.005)
    cases = thread_cases("cpu", [torch.float32, torch.float16, torch.float32, torch.bfloat16], scale=1)

    def work(i):
        name, args, kwargs, _, _ = cases[i]
        return [getattr(ops, name)(*args, **kwargs) for _ in range(3)]

    with frequent_thread_switches():
        results = run_in_threads(work, len(cases))
    for (name, _, _, ref, tol), outs in zip(cases, results):
        for out in outs:
            assert_matches(out, ref, tol)
    assert overlap["max"] == 1, f"{overlap['max']} interpreted launches ran at once"


@pytest.mark.usefixtures("poison_empty")
def test_cpu_threads_first_calls_at_once(monkeypatch):
    """The first CPU calls of a process, made from four threads at once, are serialized too.

    The threads are made to meet inside the interpreted kernel's construction (where a lazy
    one-per-process object is built), so the race is reproduced every time, not by luck."""
    interpreter.interpreted.cache_clear()
    launch.clear_plans()
    meet = threading.Barrier(4)

    class MeetingInterpretedKernel(interpreter.InterpretedKernel):
        def __init__(self, jit_function):
            with contextlib.suppress(threading.BrokenBarrierError):
                meet.wait(timeout=1.0)  # a build under a process-wide lock just times out here
            super().__init__(jit_function)

    monkeypatch.setattr(interpreter, "InterpretedKernel", MeetingInterpretedKernel)
    overlap = track_interpreter_overlap(monkeypatch, hold_s=0.02)
    cases = thread_cases("cpu", [torch.float32] * 4, scale=1)
    try:
        results = run_in_threads(lambda i: getattr(ops, cases[i][0])(*cases[i][1], **cases[i][2]), 4)
    finally:
        interpreter.interpreted.cache_clear()  # later tests build their own, once
    for (_, _, _, ref, tol), out in zip(cases, results):
        assert_matches(out, ref, tol)
    assert overlap["max"] == 1, f"{overlap['max']} interpreted launches ran at once"


def test_cpu_failed_launch_releases_the_interpreter():
    """A launch that fails inside the interpreter restores Triton's JITFunction.__call__ and
    releases the lock: the next call, from another thread, runs and is right."""
    from triton.runtime.jit import JITFunction

    compiled_call = JITFunction.__call__
    bad = TileConfig(16, 16, 3, group_m=1, num_warps=4, num_stages=1)  # tl.arange(0, 3) raises
    with pytest.raises(Exception, match="arange's range must be a power of 2"):
        ws_matmul(randn(8, 8), randn(8, 8), config=bad)
    assert JITFunction.__call__ is compiled_call
    a, b = randn(9, 10), randn(10, 11)
    (out,) = run_in_threads(lambda i: ops.ws_mm(a, b), 1, timeout_s=60)
    assert_matches(out, matmul_ref(a, b), FP32)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
def test_gpu_threads_each_on_their_own_stream():
    """Six Python threads, each launching every op on its own stream, all at once. Tensor
    descriptors need Triton's allocator, which is per thread (a ContextVar): a launch that set
    it only in the main thread would fail in the workers."""
    dtypes = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16]
    cases = thread_cases("cuda", dtypes, scale=20)
    for name, args, kwargs, _, _ in cases:
        getattr(ops, name)(*args, **kwargs)  # Triton compiles once, here, not in the race
    torch.cuda.synchronize()

    def work(i):
        name, args, kwargs, _, _ = cases[i]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            outs = [getattr(ops, name)(*args, **kwargs) for _ in range(10)]
        stream.synchronize()
        return outs

    results = run_in_threads(work, len(cases))
    for (_, _, _, ref, tol), outs in zip(cases, results):
        for out in outs:
            assert_matches(out, ref, tol)


@pytest.mark.gpu
def test_gpu_tensors_on_a_device_other_than_the_current_one():
    """Inputs on cuda:1 while cuda:0 is current (a model split across GPUs). Runs in a child
    process: a launch on the wrong device can leave the CUDA context unusable."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    script = textwrap.dedent("""
        import torch, tritonblas_ops
        from tritonblas_ops.testing import REL_TOLERANCE, rel_error, matmul_ref
        torch.cuda.set_device(0)
        for m, n, k in [(1024, 1024, 512), (1000, 999, 501)]:
            a = torch.randn(m, k, device="cuda:1", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda:1", dtype=torch.bfloat16)
            out = torch.ops.tritonblas.ws_mm(a, b)
            assert out.device == a.device, out.device
            err = rel_error(out, matmul_ref(a, b))
            assert err <= REL_TOLERANCE[torch.bfloat16], err
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]


# =======================================================================================
# 2. CUDA graphs
# =======================================================================================


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("op", ["ws_mm", "ws_bmm"])
@pytest.mark.parametrize("aligned", [True, False], ids=["descriptors", "pointers"])
def test_cuda_graph_replayed_50_times_with_new_inputs(op, aligned):
    """The counter reset is part of the captured work: a stale counter would leave every
    replay after the first with nothing to compute (NaN here)."""
    m, n, k = (1024, 1536, 768) if aligned else (1001, 1499, 767)
    batch = (4,) if op == "ws_bmm" else ()
    a = randn(*batch, m, k, dtype=torch.bfloat16, device="cuda")
    b = randn(*batch, k, n, dtype=torch.bfloat16, device="cuda")
    getattr(ops, op)(a, b)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = getattr(ops, op)(a, b)
    for _ in range(50):
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_reduce_overhead_compile_of_a_linear_model():
    """torch.compile(mode="reduce-overhead") runs the routed GEMMs inside CUDA graphs (cudagraph
    trees); replays with new inputs match the float64 model and stay as close to it as eager."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256, bias=False),
    ).cuda().to(torch.bfloat16)
    reference = copy.deepcopy(model).double()
    compiled = torch.compile(model, mode="reduce-overhead")
    counters.clear()
    try:
        # Caches off: a cache hit would skip the code generation that shows the routing.
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad(), \
                tritonblas_ops.routing(True, policy="all"):  # these small GEMMs too
            _, codes = run_and_get_code(compiled, randn(200, 512, dtype=torch.bfloat16, device="cuda"))
            routed = re.findall(r"torch\.ops\.tritonblas\.(ws_\w+)\.default\(|\b(ws_matmul_kernel)_\d+\.run\(",
                                "\n".join(codes))
            assert len(routed) == 2, f"expected both GEMMs routed, found {routed}"
            previous = None
            for _ in range(20):
                torch.compiler.cudagraph_mark_step_begin()
                x = randn(200, 512, dtype=torch.bfloat16, device="cuda")
                out = compiled(x).clone()  # the graph's output buffer is reused by the next replay
                ref = reference(x.double())
                assert_matches(out, ref, REL_TOLERANCE[torch.bfloat16])
                eager = model(x)
                assert rel_error(out, eager) <= REL_TOLERANCE[torch.bfloat16]
                assert rel_error(out, ref) <= 2 * rel_error(eager, ref) + 1e-3
                assert previous is None or not torch.equal(out, previous), "a replay served stale output"
                previous = out
        assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped"
    finally:
        torch._dynamo.reset()


# =======================================================================================
# 3. Large problems: offsets past int32
# =======================================================================================


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("use_tma", [False, True])
def test_int64_indexing_path_computes_right(use_tma):
    """The INT64_INDEX variant of the kernel itself (normally reached only past 4 GiB
    operands), forced on small problems: pointer and descriptor loads, bias, batches."""
    def run(a, b, bias=None, alpha=1.0, beta=1.0, **knobs):
        plan = launch.plan_for(a, b, bias, alpha, beta, Knobs(SMALL, use_tma=use_tma, **knobs))
        plan = dataclasses.replace(plan, int64_index=True)
        return launch.execute(plan, a, b, bias, alpha, beta)[0]

    a, b, bias = randn(40, 24), randn(24, 56).mT.contiguous().mT, randn(56)
    out = run(a, b, bias, 0.5, 2.0, num_programs=3)
    assert_matches(out, matmul_ref(a, b, bias, alpha=0.5, beta=2.0), FP32)
    a3, b3 = randn(3, 40, 24), randn(3, 24, 56)
    out = run(a3, b3, num_shards=2, num_programs=5)
    assert_matches(out, matmul_ref(a3, b3), FP32)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("batches,m,n", [(None, 65536 + 37, 32768 + 8), (9, 16384 + 5, 16384)],
                         ids=["mm", "bmm"])
def test_gpu_output_past_int32(batches, m, n, use_tma):
    """The OUTPUT has more than 2**31 elements (K is small, so it is quick): rows and batches
    past the int32 offset are written, and right."""
    k = 16
    lead = (batches,) if batches else ()
    a = randn(*lead, m, k, dtype=torch.bfloat16, device="cuda")
    b = randn(*lead, k, n, dtype=torch.bfloat16, device="cuda")
    out = ws_matmul(a, b, use_tma=use_tma)
    assert out.numel() > 2**31
    assert not torch.isnan(out).any(), "some outputs were never written"
    if batches is None:
        a, b, out = a[None], b[None], out[None]
    # (batch, rows): the first rows, the rows around element offset 2**31, the last rows.
    past = 2**31 // (m * n), (2**31 % (m * n)) // n
    for batch, row in [(0, 0), (past[0], max(past[1] - 128, 0)), (out.shape[0] - 1, m - 256)]:
        rows = slice(row, row + 256)
        assert_matches(out[batch, rows], matmul_ref(a[batch, rows], b[batch]),
                       REL_TOLERANCE[torch.bfloat16])


# =======================================================================================
# 4. Numerics like torch.mm: NaN, Inf, overflow, special alpha / beta
# =======================================================================================


def assert_specials_match(out, oracle):
    """NaN, +inf and -inf exactly where the oracle has them (any summation order gives the
    same specials: a NaN term, inf * 0, or +inf meeting -inf)."""
    for name, where in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = where(out), where(oracle)
        if not torch.equal(got, want):
            wrong = (got != want).nonzero()[:5].tolist()
            raise AssertionError(f"{name} differs from the reference at {wrong} (ours "
                                 f"{got.sum().item()}, reference {want.sum().item()})")


def plant_specials(a, b):
    """NaN / +-inf in a and b, at ragged edges and in the second K block, zeros beside them
    so that inf * 0 happens too. Batched inputs get them in their last batch only."""
    a, b = a.clone(), b.clone()
    ai, bi = (a[-1], b[-1]) if a.dim() == 3 else (a, b)
    m, k = ai.shape
    n = bi.shape[1]
    ai[3, 10] = NAN  # a whole row of NaN
    ai[5, k - 1] = INF  # last K element, past the first K block
    bi[k - 1, 2] = 0.0  # inf * 0 -> NaN at (5, 2)
    ai[6, 7], ai[6, 8] = -INF, INF  # -inf + inf -> NaN where b's rows 7 and 8 agree in sign
    bi[20, 11] = NAN  # a whole column of NaN
    bi[0, n - 1] = -INF  # last (ragged) column
    ai[m - 1, 0] = INF  # last (ragged) row, meets -inf at (m - 1, n - 1)
    return a, b


def nan_inf_cases(dtype, device, aligned=True):
    m, k, n = (37, 40, 24)  # 16-byte aligned rows, for the descriptor path; ragged tiles
    if device == "cuda":
        m, k, n = (1000, 776, 1304) if aligned else (999, 777, 1303)
    a, b = plant_specials(randn(m, k, dtype=dtype, device=device),
                          randn(k, n, dtype=dtype, device=device))
    bias = randn(n, dtype=dtype, device=device)
    bias[4], bias[5] = NAN, -INF
    a3, b3 = plant_specials(randn(2, m, k, dtype=dtype, device=device),
                            randn(2, k, n, dtype=dtype, device=device))
    return {
        "ws_mm": (torch.mm, (a, b), {}),
        "ws_addmm": (torch.addmm, (bias, a, b), {"beta": 0.5, "alpha": -2.0}),
        "ws_bmm": (torch.bmm, (a3, b3), {}),
    }


def oracle(aten, args, kwargs, dtype, device):
    """torch on the same inputs: float32 on the CPU (the interpreter accumulates in fp32),
    the same dtype on a GPU."""
    if device == "cpu":
        return aten(*[t.float() for t in args], **kwargs).to(dtype)
    return aten(*args, **kwargs)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("path", ["op", "descriptors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("op", ["ws_mm", "ws_addmm", "ws_bmm"])
def test_nan_and_inf_propagate_like_torch(op, dtype, path):
    aten, args, kwargs = nan_inf_cases(dtype, "cpu")[op]
    if path == "op":
        out = getattr(ops, op)(*args, **kwargs)
    else:  # the same kernel through tensor descriptors (16-byte aligned rows above)
        a, b = args[-2:]
        bias = args[0] if op == "ws_addmm" else None
        out = ws_matmul(a, b, bias, alpha=kwargs.get("alpha", 1.0), beta=kwargs.get("beta", 1.0),
                        config=SMALL, num_programs=3, use_tma=True)
    want = oracle(aten, args, kwargs, dtype, "cpu")
    for where in (torch.isnan, torch.isposinf, torch.isneginf):
        assert where(want).any(), "the planted values must produce every kind of special"
    assert_specials_match(out, want)
    finite = torch.isfinite(want)
    assert finite.sum() > want.numel() // 2
    ref = aten(*[t.double() for t in args], **kwargs)
    assert_matches(out[finite], ref[finite], REL_TOLERANCE[dtype])
    if op == "ws_bmm":  # the specials of the last batch stay there
        assert torch.isfinite(out[0]).all()


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("aligned", [True, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", ["ws_mm", "ws_addmm", "ws_bmm"])
def test_gpu_nan_and_inf_propagate_like_torch(op, dtype, aligned):
    aten, args, kwargs = nan_inf_cases(dtype, "cuda", aligned)[op]
    out = getattr(ops, op)(*args, **kwargs)
    want = oracle(aten, args, kwargs, dtype, "cuda")
    for where in (torch.isnan, torch.isposinf, torch.isneginf):
        assert where(want).any()
    assert_specials_match(out, want)
    finite = torch.isfinite(want)
    ref = aten(*[t.double() for t in args], **kwargs)
    assert_matches(out[finite], ref[finite], tolerance(dtype))


def fp16_overflow_case(device):
    """Sums of two fp16 values (b is all ones, K = 2): exact in fp32, then rounded to fp16.
    65504 is fp16's largest; 65520 is the midpoint to the next binade, which rounds to inf."""
    pairs = [(65504, 12), (65504, 16), (-65504, -16), (65504, -65504), (60000, 10000),
             (32768, 32752), (-40000, -30000), (1, 2)]
    a = torch.tensor(pairs, dtype=torch.float16, device=device)
    b = torch.ones(2, 5, dtype=torch.float16, device=device)
    return a, b


@pytest.mark.usefixtures("poison_empty")
def test_fp16_overflow_becomes_inf_like_torch():
    a, b = fp16_overflow_case("cpu")
    want = torch.mm(a.float(), b.float()).half()
    assert torch.isinf(want).sum() == 5 * 5 and (want.abs() == 65504).any()
    assert torch.equal(ops.ws_mm(a, b), want)
    bias = torch.tensor([65504, 1, 1, 1, 1], dtype=torch.float16)
    got = ops.ws_addmm(bias, a[-1:], b)  # 3 + 65504 stays 65504 (fp32 sum, one rounding)
    assert torch.equal(got, torch.addmm(bias.float(), a[-1:].float(), b.float()).half())


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
def test_gpu_fp16_overflow_becomes_inf_like_torch():
    a, b = fp16_overflow_case("cuda")
    want = torch.mm(a.float(), b.float()).half()  # not cuBLAS fp16: it may reduce in fp16
    assert torch.equal(ops.ws_mm(a, b), want)
    big_a = a.repeat(200, 1)  # many tiles (rows of 4 bytes: pointer loads)
    big_b = torch.ones(2, 1024, dtype=torch.float16, device="cuda")
    assert torch.equal(ops.ws_mm(big_a, big_b), torch.mm(big_a.float(), big_b.float()).half())


SPECIAL_SCALARS = [(NAN, 1.0), (1.0, NAN), (INF, 1.0), (-INF, 2.0), (1.0, INF), (1e38, 1.0)]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("alpha,beta", SPECIAL_SCALARS)
def test_special_alpha_and_beta_like_torch_addmm(alpha, beta):
    """addmm's formula, beta * bias + alpha * (a @ b), in IEEE arithmetic. The oracle scales
    outside the GEMM: CPU torch.addmm hands alpha to MKL, whose answer for a NaN or infinite
    alpha depends on the CPU's code path (with AVX2, alpha = NaN gave no NaN at all)."""
    a, b, bias = randn(21, 19), randn(19, 17), randn(17)
    bias[3] = 0.0  # inf * 0 in the epilogue
    ref = alpha * torch.mm(a.double(), b.double()) + beta * bias.double()
    want = ref.float()
    got = ops.ws_addmm(bias, a, b, alpha=alpha, beta=beta)
    assert_specials_match(got, want)
    finite = torch.isfinite(want)
    if finite.any():
        assert_matches(got[finite], ref[finite], FP32)


@pytest.mark.parametrize("case", ["K == 0, alpha NaN", "K == 0, alpha inf", "alpha == 0, NaN and inf inputs"])
def test_addmm_skips_the_product_like_torch(case):
    if case.startswith("K == 0"):
        a, b, alpha = randn(6, 0), randn(0, 7), NAN if "NaN" in case else INF
    else:
        a, b, alpha = randn(6, 5), randn(5, 7), 0.0
        a[1, 1], b[2, 3] = NAN, INF
    bias = randn(7)
    want = torch.addmm(bias, a, b, alpha=alpha, beta=0.5)
    assert torch.isfinite(want).all()  # torch's answer: beta * bias
    assert_matches(ops.ws_addmm(bias, a, b, alpha=alpha, beta=0.5), want.double(), FP32)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("a_layout", ["row", "col"])
def test_gpu_zero_k(a_layout):
    """K = 0 on the GPU: zeros (written, not left as the NaN poison) and beta * bias; a
    column-major (M, 0) operand has 16-byte aligned strides, so descriptors see a 0 extent."""
    m, n = 1024, 768
    a = torch.empty(m, 0, dtype=torch.bfloat16, device="cuda") if a_layout == "row" else \
        torch.empty(0, m, dtype=torch.bfloat16, device="cuda").t()
    b = torch.empty(0, n, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(ops.ws_mm(a, b), torch.zeros(m, n, dtype=torch.bfloat16, device="cuda"))
    bias = randn(n, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(ops.ws_addmm(bias, a, b, beta=2.0), torch.addmm(bias, a, b, beta=2.0))
    a3, b3 = a.expand(3, m, 0), b.expand(3, 0, n)
    assert torch.equal(ops.ws_bmm(a3, b3), torch.zeros(3, m, n, dtype=torch.bfloat16, device="cuda"))


# =======================================================================================
# 5. Determinism
# =======================================================================================

# Descriptors, pointer loads, and split-K (16 slices of 8 tiles: the sums run as units of their own)
DETERMINISM_SHAPES = [(3000, 2000, 4000), (2999, 2001, 4001), (256, 32768, 512)]
DETERMINISM_IDS = ["aligned", "ragged", "split_k"]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", DETERMINISM_SHAPES, ids=DETERMINISM_IDS)
def test_gpu_bitwise_identical_over_100_runs(m, k, n):
    a = randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = randn(k, n, dtype=torch.bfloat16, device="cuda")
    first = ops.ws_mm(a, b)
    for run in range(100):
        assert torch.equal(ops.ws_mm(a, b), first), f"run {run} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", DETERMINISM_SHAPES, ids=DETERMINISM_IDS)
def test_gpu_bitwise_identical_while_another_kernel_holds_sms(m, k, n):
    """benchmarks/sm_hog.py holds H SMs from another stream while the GEMM runs: only the
    other programs take tiles, so tiles land on different programs from run to run (and on
    fewer of them as H grows). The result must not change by a bit, and the GEMM must be
    done while the hog still holds its SMs: nothing waits for a program that has not
    started (split-K's sums wait only for slices that running programs claimed)."""
    from benchmarks.sm_hog import hold_sms

    a = randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = randn(k, n, dtype=torch.bfloat16, device="cuda")
    first = ops.ws_mm(a, b)
    sms = devices.num_compute_units(torch.device("cuda", torch.cuda.current_device()))
    held = [h for h in (4, 17, 33, 66, 100, 120) if h < sms]
    hog_stream, gemm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    hold_sms(1, 1.0, hog_stream).check_distinct_sms()  # compile the hog outside the loop
    torch.cuda.synchronize()
    for run in range(100):
        h = held[run % len(held)]
        hold = hold_sms(h, duration_ms=20.0, stream=hog_stream)
        time.sleep(0.002)  # the hog's blocks are resident before the GEMM arrives
        assert hold.active(), "the hog finished before the GEMM was launched"
        with torch.cuda.stream(gemm_stream):
            out = ops.ws_mm(a, b)
        gemm_stream.synchronize()
        assert hold.active(), f"run {run}: the GEMM waited for the {h} held SMs"
        hold.check_distinct_sms()
        assert torch.equal(out, first), f"run {run} with {h} SMs held differs"


# =======================================================================================
# 6. Fuzzing against the float64 reference
# =======================================================================================

LAYOUTS = ["row", "col", "sliced", "col_sliced", "no_unit_stride", "broadcast"]
BIASES = [None, "row", "column", "full", "full_transposed", "scalar"]


def make_operand(shape, dtype, layout, device, generator):
    """A tensor of `shape` ((R, C) or (B, R, C)) stored in `layout`."""
    *batch, rows, cols = shape

    def fresh(*s):
        return torch.randn(*s, generator=generator, device=device).to(dtype)

    if layout == "row":
        return fresh(*batch, rows, cols)
    if layout == "col":
        return fresh(*batch, cols, rows).mT
    if layout == "sliced":  # an offset view: unaligned base, padded leading stride
        return fresh(*batch, rows + 3, cols + 5)[..., 1 : 1 + rows, 2 : 2 + cols]
    if layout == "col_sliced":
        return fresh(*batch, cols + 4, rows + 2)[..., 3 : 3 + cols, 1 : 1 + rows].mT
    if layout == "no_unit_stride":
        return fresh(*batch, 2 * rows, 3 * cols)[..., ::2, ::3]
    if layout == "broadcast":  # one row (and one batch) repeated: strides of 0
        return fresh(*[1] * len(batch), 1, cols).expand(*batch, rows, cols)
    raise ValueError(layout)


def surely_descriptor_friendly(problem) -> bool:
    """Whether tensor descriptors can take the operands: fresh row- or column-major storage
    with 16-byte aligned strides (worked out from the layout, not asked of the kernel)."""
    p = problem
    size = torch.tensor([], dtype=p["dtype"]).element_size()
    batches = p["batch"] or 1
    for layout, rows, cols in (p["a_layout"], p["m"], p["k"]), (p["b_layout"], p["k"], p["n"]):
        if layout not in ("row", "col"):
            return False
        lead = cols if layout == "row" else rows
        if (lead * size) % 16 or (batches > 1 and (rows * cols * size) % 16):
            return False
    return (p["n"] * size) % 16 == 0 and (batches == 1 or (p["m"] * p["n"] * size) % 16 == 0)


@st.composite
def gemm_problems(draw, max_dim, dtypes, max_programs, cpu):
    use_tma = draw(st.sampled_from([None, False, True]))
    # use_tma=True draws layouts descriptors can take: row- or column-major, rows of a
    # multiple of 16 bytes. The other draws may use any layout.
    layouts = ["row", "col"] if use_tma else LAYOUTS
    dims = st.one_of(st.integers(1, max_dim), st.integers(max_dim // 2, max_dim))  # not all tiny
    if use_tma or draw(st.booleans()):
        dims = dims.map(lambda d: min(-(-d // 8) * 8, max_dim // 8 * 8))  # multiples of 8
    batch = draw(st.sampled_from([None, None, 1, 3]))
    return {
        "batch": batch,
        "m": draw(dims),
        "n": draw(dims),
        "k": draw(dims),
        "dtype": draw(st.sampled_from(dtypes)),
        "a_layout": draw(st.sampled_from(layouts)),
        "b_layout": draw(st.sampled_from(layouts)),
        "bias": None if batch else draw(st.sampled_from(BIASES)),
        "alpha": draw(st.sampled_from([1.0, 0.5, -2.0])),
        "beta": draw(st.sampled_from([1.0, 0.0, -0.75])),
        "num_shards": draw(st.integers(1, 8)),
        "num_programs": draw(st.one_of(st.none(), st.integers(1, max_programs))),
        "schedule": draw(st.sampled_from(list(Schedule))),
        "use_tma": use_tma,
        "config": draw(st.sampled_from([None, SMALL])) if cpu else None,
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def check_problem(p, device):
    note(repr(p))
    g = torch.Generator(device=device).manual_seed(p["seed"])
    lead = (p["batch"],) if p["batch"] else ()
    m, n, k, dtype = p["m"], p["n"], p["k"], p["dtype"]
    a = make_operand((*lead, m, k), dtype, p["a_layout"], device, g)
    b = make_operand((*lead, k, n), dtype, p["b_layout"], device, g)
    bias = None
    if p["bias"] is not None:
        shape = {"row": (n,), "column": (m, 1), "full": (m, n), "full_transposed": (n, m),
                 "scalar": ()}[p["bias"]]
        bias = torch.randn(shape, generator=g, device=device).to(dtype)
        if p["bias"] == "full_transposed":
            bias = bias.t()
    use_tma = p["use_tma"]
    assert not use_tma or surely_descriptor_friendly(p), "the strategy drew an unaligned use_tma=True"
    event(f"use_tma={use_tma}")
    event(f"layouts {p['a_layout']} @ {p['b_layout']}")
    out = ws_matmul(a, b, bias, alpha=p["alpha"], beta=p["beta"], config=p["config"],
                    num_shards=p["num_shards"], num_programs=p["num_programs"],
                    schedule=p["schedule"], use_tma=use_tma)
    assert out.dtype == dtype and out.shape == (*lead, m, n)
    # Relative to the terms' size: with a few rows, columns and K steps a draw's sums can
    # cancel, and the result's own norm would then make fp32 rounding look like an error.
    assert_matches(out, matmul_ref(a, b, bias, alpha=p["alpha"], beta=p["beta"]), tolerance(dtype),
                   scale=matmul_magnitude(a, b, bias, alpha=p["alpha"], beta=p["beta"]))


CPU_FUZZ_EXAMPLES = 40
GPU_FUZZ_EXAMPLES = 80
FUZZ_SETTINGS = dict(
    deadline=None, derandomize=False, database=None, print_blob=True,
    # poison_empty is process-wide state, right for every example of the test.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.usefixtures("poison_empty")
@settings(max_examples=CPU_FUZZ_EXAMPLES, **FUZZ_SETTINGS)
@given(gemm_problems(max_dim=80, dtypes=[torch.float32, torch.float16], max_programs=9, cpu=True))
def test_fuzz_cpu(problem):
    check_problem(problem, "cpu")


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@settings(max_examples=GPU_FUZZ_EXAMPLES, **FUZZ_SETTINGS)
@given(gemm_problems(max_dim=3000, dtypes=[torch.bfloat16, torch.float16, torch.float32],
                     max_programs=300, cpu=False))
def test_fuzz_gpu(problem):
    check_problem(problem, "cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("use_tma", [None, False])
def test_gpu_broadcast_operands(use_tma):
    """Operands with a stride of 0 (a row, or a batch, repeated by expand): the descriptor
    check accepts a 0 stride as aligned, so this is where a descriptor meets one."""
    x = randn(1, 512, dtype=torch.bfloat16, device="cuda").expand(1024, 512)
    w = randn(512, 768, dtype=torch.bfloat16, device="cuda")
    assert_matches(ws_matmul(x, w, use_tma=use_tma), matmul_ref(x, w), REL_TOLERANCE[torch.bfloat16])
    a3 = randn(4, 1024, 512, dtype=torch.bfloat16, device="cuda")
    shared = w[None].expand(4, 512, 768)  # one weight for every batch: batch stride 0
    assert_matches(ws_matmul(a3, shared, use_tma=use_tma), matmul_ref(a3, shared),
                   REL_TOLERANCE[torch.bfloat16])


# =======================================================================================
# 7. Hostile input: the exact error, no crash, no harm to later calls
# =======================================================================================
# Cases test_ops.py already has (ranks, inner sizes, dtype pairs, fp64 / int32, meta vs cpu,
# a float for a tensor, batch sizes, bias shape and dtype) are not repeated. There is no
# out= variant of the ops, so there is no output-aliasing case to test.

A = torch.randn(4, 5)
B = torch.randn(5, 6)


def _quietly(make):
    """Builds an input whose constructor warns (prototype / beta layouts) without the warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()


HOSTILE_INPUTS = {
    # None where a tensor belongs reaches the checks and fails on an attribute: not the
    # clear message of the other cases (reported with issue 6), but an exception, not a crash.
    "None for a": ("ws_mm", (None, B), {}, TypeError, r"ws_mm: a must be a Tensor, got NoneType"),
    "None for bias": ("ws_addmm", (None, A, B), {}, TypeError, r"ws_addmm: bias must be a Tensor, got NoneType"),
    "list for a": ("ws_mm", (A.tolist(), B), {}, RuntimeError,
                   r"tritonblas::ws_mm\(\) Expected a value of type 'Tensor' for argument 'a' but instead found type 'list'"),
    "list for b": ("ws_bmm", (A[None], B[None].tolist()), {}, RuntimeError,
                   r"tritonblas::ws_bmm\(\) Expected a value of type 'Tensor' for argument 'b' but instead found type 'list'"),
    "complex64": ("ws_mm", (A.to(torch.complex64), B.to(torch.complex64)), {}, RuntimeError,
                  r"ws_mm: dtype torch.complex64 is not supported; use float16, bfloat16 or float32"),
    "bool": ("ws_mm", (A > 0, B > 0), {}, RuntimeError, r"ws_mm: dtype torch.bool is not supported"),
    "float8": ("ws_mm", (A.to(torch.float8_e4m3fn), B.to(torch.float8_e4m3fn)), {}, RuntimeError,
               r"ws_mm: dtype torch.float8_e4m3fn is not supported"),
    "0-d mm": ("ws_mm", (torch.tensor(1.0), torch.tensor(2.0)), {}, RuntimeError,
               r"ws_mm: a must be a 2-D tensor, got shape \(\)"),
    "0-d bmm": ("ws_bmm", (torch.tensor(1.0), torch.tensor(2.0)), {}, RuntimeError,
                r"ws_bmm: a must be a 3-D tensor, got shape \(\)"),
    "0-d a in addmm": ("ws_addmm", (torch.tensor(1.0), torch.tensor(1.0), B), {}, RuntimeError,
                       r"ws_addmm: a must be a 2-D tensor, got shape \(\)"),
    # Non-contiguous biases whose dims do not match the (4, 6) output.
    "transposed bias": ("ws_addmm", (torch.randn(4, 6).t(), A, B), {}, RuntimeError,
                        r"ws_addmm: bias of shape \(6, 4\) does not broadcast to \(4, 6\)"),
    "strided bias": ("ws_addmm", (torch.randn(4, 8)[:, ::2], A, B), {}, RuntimeError,
                     r"ws_addmm: bias of shape \(4, 4\) does not broadcast to \(4, 6\)"),
    "sliced column bias": ("ws_addmm", (torch.randn(6, 3)[:, 0:1], A, B), {}, RuntimeError,
                           r"ws_addmm: bias of shape \(6, 1\) does not broadcast to \(4, 6\)"),
    "int64 bias": ("ws_addmm", (torch.randn(6).long(), A, B), {}, RuntimeError,
                   r"ws_addmm: bias must have the dtype of a and b \(torch.float32\), got torch.int64"),
    # Integer tensors cannot require grad (torch refuses to make one), so: a float tensor
    # that requires grad beside an integer one.
    "requires_grad beside int": ("ws_mm", (A.clone().requires_grad_(), B.int()), {}, RuntimeError,
                                 r"ws_mm: a and b must have the same dtype, got torch.float32 and torch.int32"),
    "str beta": ("ws_addmm", (torch.randn(6), A, B), {"beta": "2"}, RuntimeError,
                 r"Expected a value of type 'float' for argument 'beta' but instead found type 'str'"),
    "complex alpha": ("ws_addmm", (torch.randn(6), A, B), {"alpha": 1j}, RuntimeError,
                      r"Expected a value of type 'float' for argument 'alpha' but instead found type 'complex'"),
    "unknown keyword": ("ws_addmm", (torch.randn(6), A, B), {"gamma": 1.0}, RuntimeError,
                        r"Unknown keyword argument 'gamma' for operator 'tritonblas::ws_addmm'"),
    "extra argument": ("ws_mm", (A, B, B), {}, RuntimeError,
                       r"tritonblas::ws_mm\(\) expected at most 2 argument\(s\) but received 3"),
    "missing argument": ("ws_mm", (A,), {}, RuntimeError, r"tritonblas::ws_mm\(\) is missing value for argument 'b'"),
    "nested tensor": ("ws_mm", (_quietly(lambda: torch.nested.nested_tensor([A, A])), B), {}, NotImplementedError,
                      r"Could not run 'tritonblas::ws_mm' with arguments from the 'NestedTensorCPU' backend"),
    # Sparse layouts pass the checks and fail inside ws_matmul with torch's own message
    # (reported with issue 6: the checks should refuse non-strided layouts by name).
    "sparse COO": ("ws_mm", (A.to_sparse(), B), {}, RuntimeError, r"ws_mm: a must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    "sparse CSR": ("ws_mm", (_quietly(A.to_sparse_csr), B), {}, RuntimeError, r"ws_mm: a must be a dense \(strided\) tensor, got layout torch.sparse_csr"),
}


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("case", list(HOSTILE_INPUTS))
def test_hostile_input_is_refused_and_later_calls_are_right(case):
    name, args, kwargs, error, message = HOSTILE_INPUTS[case]
    with pytest.raises(error, match=message):
        getattr(ops, name)(*args, **kwargs)
    # Nothing half-done: the next good calls are right, on the kernel's real path.
    a, b, bias = randn(24, 19), randn(19, 33), randn(33)
    assert_matches(ops.ws_mm(a, b), matmul_ref(a, b), FP32)
    assert_matches(ops.ws_addmm(bias, a, b, beta=0.5), matmul_ref(a, b, bias, beta=0.5), FP32)


@pytest.mark.usefixtures("poison_empty")
def test_not_errors_alpha_as_bool_and_meta_tensors():
    """Inputs that look hostile but are valid, as for torch.addmm: a bool alpha is a number;
    meta tensors get the output's shape and dtype without computing anything."""
    a, b, bias = randn(6, 7), randn(7, 8), randn(8)
    got = ops.ws_addmm(bias, a, b, alpha=True, beta=False)
    assert_matches(got, matmul_ref(a, b), FP32)
    out = ops.ws_addmm(randn(8, device="meta"), randn(6, 7, device="meta"), randn(7, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (6, 8) and out.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_empty")
def test_gpu_cuda_and_cpu_mixed():
    dev = torch.device("cuda", torch.cuda.current_device())
    ga, gb, gbias = randn(64, 48, device="cuda"), randn(48, 32, device="cuda"), randn(32, device="cuda")
    ca, cb, cbias = ga.cpu(), gb.cpu(), gbias.cpu()
    cases = [
        ("ws_mm", (ga, cb), rf"ws_mm: a and b must be on the same device, got {dev} and cpu"),
        ("ws_mm", (ca, gb), rf"ws_mm: a and b must be on the same device, got cpu and {dev}"),
        ("ws_bmm", (ga[None], cb[None]), rf"ws_bmm: a and b must be on the same device, got {dev} and cpu"),
        ("ws_addmm", (cbias, ga, gb), rf"ws_addmm: bias must be on {dev}, got cpu"),
        ("ws_addmm", (gbias, ca, cb), rf"ws_addmm: bias must be on cpu, got {dev}"),
        ("ws_addmm", (torch.tensor(1.0), ga, gb), rf"ws_addmm: bias must be on {dev}, got cpu"),
    ]
    for name, args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            getattr(ops, name)(*args)
        assert_matches(ops.ws_addmm(gbias, ga, gb), matmul_ref(ga, gb, gbias), tolerance(torch.float32))


# =======================================================================================
# 8. No leaks
# =======================================================================================


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_cpu_no_leak_over_200_calls():
    """200 interpreted calls: no Python objects left behind (a leaked output or cache entry
    per call would add >= 200) and no RSS growth beyond allocator noise."""
    a, b, bias = randn(8, 8), randn(8, 8), randn(8)
    for _ in range(20):  # fill every cache first
        ops.ws_mm(a, b), ops.ws_addmm(bias, a, b)
    objects, rss = tracked_objects(), rss_bytes()
    # Triton 3.6's interpreter warns on every call (a numpy deprecation), and pytest keeps
    # each recorded warning: two objects a call that are pytest's, not ours.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(200):
            out = ops.ws_addmm(bias, a, b) if i % 2 else ops.ws_mm(a, b)
    del out
    grown = tracked_objects() - objects
    assert grown < 100, f"{grown} more Python objects after 200 calls"
    assert rss_bytes() - rss < 16 * 2**20, f"RSS grew by {(rss_bytes() - rss) / 2**20:.1f} MiB"


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_gpu_no_leak_over_10000_calls():
    """10,000 calls of every op, both load paths, on 64x64 operands.

    GPU: memory_allocated must come back to where it was, within 1 MiB; one leaked 64x64
    output (8 KiB) or counter buffer (256 B, in a 512 B block) per call would be >= 4.8 MiB.
    Host: no more than 1,000 new Python objects (one per call would be 10,000), and RSS
    within 16 MiB, which is allocator and driver noise; a leak of >= 1.7 KiB per call is more.
    """
    def t(*shape):
        return randn(*shape, dtype=torch.bfloat16, device="cuda")

    a, b, bias, a3, b3 = t(64, 64), t(64, 64), t(64), t(2, 64, 64), t(2, 64, 64)
    sliced = t(64, 72)[:, 3:67]  # unaligned base: pointer loads
    calls = [lambda: ops.ws_mm(a, b), lambda: ops.ws_addmm(bias, a, b, beta=0.5),
             lambda: ops.ws_bmm(a3, b3), lambda: ops.ws_mm(sliced, b)]
    for i in range(400):  # warm every path and cache
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    allocated, objects, rss = torch.cuda.memory_allocated(), tracked_objects(), rss_bytes()
    for i in range(10_000):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    grown_gpu = torch.cuda.memory_allocated() - allocated
    grown_objects = tracked_objects() - objects
    grown_rss = rss_bytes() - rss
    assert grown_gpu <= 2**20, f"GPU memory grew by {grown_gpu} bytes over 10,000 calls"
    assert grown_objects < 1000, f"{grown_objects} more Python objects over 10,000 calls"
    assert grown_rss < 16 * 2**20, f"RSS grew by {grown_rss / 2**20:.1f} MiB over 10,000 calls"

"""Counter buffers (tritonblas_ops/counters.py), checked launches (launch.set_checked) and the
plan cache under concurrent callers: no buffer is handed out twice or lost, no stale counter
goes unnoticed in checked mode, and a failed launch leaves later ones right."""

import sys
import time

import pytest
import torch

import tritonblas_ops  # noqa: F401  (registers the ops)
from tritonblas_ops import counters, launch
from tritonblas_ops.config import TileConfig
from tritonblas_ops.launch import ws_matmul
from tritonblas_ops.plan import Knobs
from concurrency import frequent_thread_switches, run_in_threads
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref

CPU = torch.device("cpu")
FP32 = REL_TOLERANCE[torch.float32]


@pytest.fixture
def fresh_pool(monkeypatch):
    """An empty buffer pool, whose buffers take a while to make (widening any race)."""
    monkeypatch.setattr(counters, "_eager", {})
    make = counters._lasting_zeros

    def slowly(numel, device):
        time.sleep(0.01)
        return make(numel, device)

    monkeypatch.setattr(counters, "_lasting_zeros", slowly)


@pytest.mark.usefixtures("fresh_pool")
def test_threads_asking_at_once_share_one_buffer():
    """Eight threads ask for a CPU buffer at first use, half of them for more than the
    others (a growth): each gets the buffer that stays in the pool, or one it replaced
    that launches queued before may still use; none is made twice for one size."""
    with frequent_thread_switches():
        got = run_in_threads(lambda i: counters.zeroed(64 if i % 2 else 256, CPU), 8)
    final = counters.zeroed(1, CPU)
    assert final.numel() >= 256 and all(t.numel() >= (64 if i % 2 else 256) for i, t in enumerate(got))
    assert all(t is final for t in got if t.numel() >= 256)
    assert len({id(t) for t in got}) <= 2


def test_plan_cache_evictions_from_many_threads(monkeypatch):
    """More distinct shapes than the cache holds, from eight threads at once: evictions
    never race (no KeyError after a launch) and every result is right."""
    monkeypatch.setattr(launch, "MAX_PLANS", 3)
    launch.clear_plans()

    def work(i):
        outs = []
        for j in range(4):
            a, b = torch.randn(3 + i, 5 + j), torch.randn(5 + j, 4)
            outs.append((ws_matmul(a, b), matmul_ref(a, b)))
        return outs

    with frequent_thread_switches():
        results = run_in_threads(work, 8)
    for outs in results:
        for out, ref in outs:
            assert_matches(out, ref, FP32)
    assert len(launch.cached_plans()) <= 3


@pytest.mark.usefixtures("checked")
def test_checked_launches_refuse_counters_left_set_and_reset_them():
    a, b = torch.randn(40, 30), torch.randn(30, 50)
    queue = launch.plan_for(a, b, None, 1.0, 1.0).queue
    buffer = counters.zeroed(queue.numel, CPU)
    buffer[0] = 5  # shard 0's claim counter, as a launch aborted midway could leave it
    with pytest.raises(RuntimeError, match="counters found in an impossible state before a launch "
                                           r"\(reset now\): shard 0's claim counter is 5, not 0"):
        ws_matmul(a, b)
    assert_matches(ws_matmul(a, b), matmul_ref(a, b), FP32)
    assert (counters.zeroed(queue.numel, CPU) == 0).all()


@pytest.mark.usefixtures("checked")
def test_checked_launches_see_what_went_wrong_inside(monkeypatch):
    """A launch that leaves a counter set or skips a unit (simulated: the kernel launch
    below sets the arrival counter of a split-K tile) raises, naming it, and the buffer is
    clean for the next launch."""
    a, b = torch.randn(20, 90), torch.randn(90, 24)
    config = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=3)
    real_launch = launch.launch_kernel

    def leaves_a_counter_set(plan, a, b, c, bias, counters, *args, **kwargs):
        launched = real_launch(plan, a, b, c, bias, counters, *args, **kwargs)
        counters[plan.queue.arrivals_offset + 1] = 1
        return launched

    monkeypatch.setattr(launch, "launch_kernel", leaves_a_counter_set)
    with pytest.raises(RuntimeError, match="the arrival counter of tile 1 is 1, not 0"):
        ws_matmul(a, b, config=config, num_programs=3)
    monkeypatch.setattr(launch, "launch_kernel", real_launch)
    assert_matches(ws_matmul(a, b, config=config, num_programs=3), matmul_ref(a, b), FP32)


def test_a_cpu_launch_that_raised_midway_leaves_its_buffer_zero(monkeypatch):
    """The interpreter can raise after the first claims: the buffer is zeroed again before
    any other CPU launch can take it."""
    a, b = torch.randn(40, 30), torch.randn(30, 50)
    real_launch = launch.launch_kernel

    def raises_midway(plan, a, b, c, bias, counters, *args, **kwargs):
        counters[0] = 3
        raise RuntimeError("interrupted")

    monkeypatch.setattr(launch, "launch_kernel", raises_midway)
    with pytest.raises(RuntimeError, match="interrupted"):
        ws_matmul(a, b, num_shards=2)
    monkeypatch.setattr(launch, "launch_kernel", real_launch)
    assert (counters.zeroed(1, CPU) == 0).all()
    assert_matches(ws_matmul(a, b, num_shards=2), matmul_ref(a, b), FP32)


def test_checked_mode_is_off_by_default_and_read_from_the_environment():
    import os
    import subprocess

    from subprocess_helpers import REPO

    script = "import tritonblas_ops; print(tritonblas_ops.is_checked())"
    for value, expected in ((None, "False"), ("1", "True"), ("off", "False")):
        env = {k: v for k, v in os.environ.items() if k != launch.CHECKED_ENV}
        if value is not None:
            env[launch.CHECKED_ENV] = value
        env["PYTHONPATH"] = str(REPO)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == expected, value


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_pool", "poison_empty")
def test_gpu_threads_on_shared_and_separate_streams_at_first_use():
    """Eight threads, two per stream, launch at once into an empty pool: one buffer per
    (device, stream), every result right."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.Stream() for _ in range(4)]
    inputs = [(torch.randn(2048 + 64 * i, 1024, device="cuda", dtype=torch.bfloat16),
               torch.randn(1024, 1536, device="cuda", dtype=torch.bfloat16)) for i in range(8)]
    torch.ops.tritonblas.ws_mm(*inputs[0])  # Triton compiles here, not in the race
    torch.cuda.synchronize()
    counters._eager.clear()

    def work(i):
        with torch.cuda.stream(streams[i % 4]):
            outs = [torch.ops.tritonblas.ws_mm(*inputs[i]) for _ in range(10)]
        streams[i % 4].synchronize()
        return outs

    results = run_in_threads(work, 8)
    for (a, b), outs in zip(inputs, results):
        ref = matmul_ref(a, b)
        for out in outs:
            assert_matches(out, ref, REL_TOLERANCE[torch.bfloat16])
    keys = [key for key in counters._eager if key[0] == device.index]
    assert sorted(key[1] for key in keys) == sorted(s.cuda_stream for s in streams)


@pytest.mark.gpu
def test_gpu_failed_launch_keeps_its_buffer():
    """A launch that raises (here: a tile config needing more shared memory than an SM has)
    never ran: the stream's buffer is still zero and stays in use."""
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    torch.ops.tritonblas.ws_mm(a, b)
    device = a.device
    buffer = counters.zeroed(1, device)
    too_big = TileConfig(256, 256, 128, num_warps=8, num_stages=8)
    with pytest.raises(Exception, match="(?i)resources|shared memory"):
        ws_matmul(a, b, config=too_big)
    assert counters.zeroed(1, device) is buffer and (buffer == 0).all()
    assert_matches(torch.ops.tritonblas.ws_mm(a, b), matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_checked_launches_pass_on_clean_counters(checked):
    """Checked mode over every kind of launch: the tally matches and nothing is left set."""
    for m, n, k in [(4096, 4096, 4096), (256, 512, 32768), (5, 4000, 4096), (1000, 1000, 1000)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        assert_matches(ws_matmul(a, b), matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])
        assert_matches(ws_matmul(a, b, num_programs=37), matmul_ref(a, b), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_a_split_k_sum_never_waits_forever():
    """An arrival counter that can never reach SPLIT_K, on the GPU: the launch returns (the
    sums give up after max_spins polls), its rows are NaN and the status says why."""
    import dataclasses

    from tritonblas_ops import scheduler

    a = torch.randn(256, 32768, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32768, 512, device="cuda", dtype=torch.bfloat16)
    plan = launch.plan_for(a, b, None, 1.0, 1.0, Knobs(num_programs=200))
    assert plan.config.split_k > 1 and plan.queue.work_stealing
    plan = dataclasses.replace(plan, max_spins=1000)
    buffer = torch.zeros(plan.queue.numel, dtype=torch.int32, device="cuda")
    buffer[plan.queue.arrivals_offset] = -1000
    out = torch.zeros(plan.out_shape, dtype=a.dtype, device="cuda")
    a_arg, b_arg, _, partials = launch.operands(plan, a, b, None)
    start = time.perf_counter()
    launch.launch_kernel(plan, a_arg, b_arg, out, None, buffer, partials, 1.0, 1.0)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 60
    problems = plan.queue.problems(buffer.tolist())
    assert scheduler.STATUS_NAMES[scheduler.STATUS_WAIT_TIMED_OUT] in problems
    assert torch.isnan(out).any() and torch.isfinite(out).sum() > 0

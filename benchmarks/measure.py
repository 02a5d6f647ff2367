"""Timing and the correctness gate every provider passes before it is timed."""

import time
from typing import Callable

import torch

from tritonblas_ops import testing

QUANTILES = (0.2, 0.5, 0.8)

# Relative Frobenius error against float64 that the gate lets through, per input dtype (fp32
# runs as TF32 on the GPU). Looser than tritonblas_ops.testing.REL_TOLERANCE, the kernel's
# contract that the tests hold: the gate also passes the baselines, which may reduce in
# lower precision (cuBLAS split-K under allow_{fp16,bf16}_reduced_precision_reduction,
# Inductor's decompose-K), and it only has to stop broken outputs, which miss by orders of
# magnitude. Every row records the error measured, to hold against the contract.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-2}

# Output rows the float64 reference computes: enough to cover every tile row of a large
# GEMM at 128-row tiles, few enough that the reference stays cheap next to the GEMM.
REFERENCE_ROWS = 256

MIN_CPU_REPS = 3


def time_ms(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup_ms: float,
            rep_ms: float) -> dict[str, tuple[float, float, float]]:
    """{name: (p20, p50, p80) milliseconds of GPU time of one call of fn}, with a cold L2.

    On the GPU, each fn is captured in a CUDA graph, GRAPH_CALLS times, each call after a
    256 MB write that evicts L2; one more graph holds the writes alone. All graphs are
    replayed in turn, so slow drifts (clocks, heat) hit every fn alike (timed one after the
    other, the last fn ran on a warmer GPU: NOTES.md step 13), and a call's time is the
    difference of its graph's and the writes' median replay times over GRAPH_CALLS.
    Replaying takes the host out of the number: an eager call's host time is what the
    --overhead mode measures. (triton.testing.do_bench, timing eager calls, reported the
    host's time, not the GPU's, for every GEMM shorter than a launch.) rep_ms is GPU time
    per fn.
    On the CPU (--smoke) it is perf_counter around each call, at least MIN_CPU_REPS calls.
    """
    if device.type == "cuda":
        return _graph_time_ms(fns, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return {name: _cpu_time_ms(fn, rep_ms) for name, fn in fns.items()}


GRAPH_CALLS = 8
FLUSH_BYTES = 256 * 2**20
FLUSH = object()  # the key of the graph of L2 flushes alone


def _graph_time_ms(fns, *, warmup_ms: float, rep_ms: float) -> dict[str, tuple[float, float, float]]:
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and allocate before capturing
        for fn in fns.values():
            for _ in range(3):
                fn()
    torch.cuda.current_stream().wait_stream(side)

    def capture(fn) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                flush.zero_()
                if fn is not None:
                    fn()
        return graph

    graphs = {name: capture(fn) for name, fn in fns.items()}
    graphs[FLUSH] = capture(None)

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def round_ms() -> float:
        return sum(replay_ms(graph) for graph in graphs.values())

    deadline = time.perf_counter() + warmup_ms * len(fns) / 1e3
    per_round = round_ms()
    while time.perf_counter() < deadline:  # clocks up; sizes the timed run
        per_round = round_ms()
    rounds = max(10, int(rep_ms * len(fns) / per_round))
    samples = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            samples[name].append(replay_ms(graph))
    flush_ms = quantiles(samples.pop(FLUSH))[1]
    return {name: tuple((t - flush_ms) / GRAPH_CALLS for t in quantiles(times))
            for name, times in samples.items()}


def _cpu_time_ms(fn, rep_ms):
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < MIN_CPU_REPS or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return quantiles(times)


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(q.tolist())


def reference_rows(m: int) -> torch.Tensor:
    """Evenly spaced output rows, always with the last one (it sits in the ragged edge tile)."""
    step = max(1, m // REFERENCE_ROWS)
    return torch.unique(torch.cat([torch.arange(0, m, step), torch.tensor([m - 1])]))


def matmul_ref(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 (a @ b)[rows], by the reference the tests use."""
    return testing.matmul_ref(a[rows.to(a.device)], b)


def poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Make the next output allocation of `numel` elements come back full of NaN.

    The providers allocate their own outputs. With the cache emptied, the NaN block freed
    here is the only cached block of that size, so the caching allocator hands it to the
    provider's output (not an earlier provider's output, which holds the right answer):
    any element the provider forgets to write reads NaN and fails the check. (On the CPU
    the allocator may not reuse it; the float64 comparison still catches garbage.)
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.empty(numel, dtype=dtype, device=device).fill_(float("nan"))


def check(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, tolerance: float, what: str) -> float:
    """Relative error of out[rows] against ref; raises, saying where, past tolerance.

    The whole output must be finite (catches unwritten tiles outside the sampled rows).
    """
    finite = torch.isfinite(out)
    if not finite.all():
        bad = (~finite).nonzero()
        raise AssertionError(f"{what}: {len(bad)} non-finite outputs, first at (row, col) "
                             f"{tuple(bad[0].tolist())}")
    sampled = out[rows.to(out.device)]
    error = testing.rel_error(sampled, ref)
    if not error <= tolerance:
        index, col = divmod((sampled.double() - ref).abs().argmax().item(), ref.shape[1])
        row = rows[index].item()
        raise AssertionError(
            f"{what}: relative error {error:.3g} > {tolerance:g}; worst at (row, col) ({row}, {col}): "
            f"got {out[row, col].item():.6g}, expected {ref[index, col].item():.6g}"
        )
    return error

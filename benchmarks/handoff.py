"""SMs handed to a kernel launched while a GEMM runs (issue "SMs on demand", part 1).

    python -m benchmarks.handoff --out benchmarks/results/h200_handoff.csv

A GEMM is queued on one stream; REQUEST_US later (host time) another stream asks for H
whole SMs: sm_hog's kernel, H blocks that each take a whole SM and spin for HOLD_US, on a
stream of normal or of high priority. The late kernel's wait is the time from its request
(an event recorded on its stream right before it, and before the budget's write) to its
end, less HOLD_US: when its last block got an SM. The GEMM's time is events around it.
The hog's buffers are allocated, and its kernel compiled, before any trial, so what the
late stream queues after its request is only the budget's write (ws_live, idle) and the
kernel's launch; `write_us` is the request to the end of the write (an event after it).
The wait still counts the host's time to queue these after recording the request, and
the GPU's time to start a kernel: `idle`, the same late side with no GEMM, measures that
floor; a provider's wait above it is the GEMM's.
Providers:
  torch_mm           cuBLAS
  torch_mm_carveout  cuBLAS with torch's SM carve-out set to H before the GEMM launches
  ws                 ws_mm, no live budget: the late kernel waits for programs to finish
  ws_live            ws_mm under a LiveBudget, lowered to SMs - H on the late stream (a
                     stream write) right before the late kernel
  idle               no GEMM; the late side of ws_live (the write, then the kernel): the floor
Each row: the median of TRIALS trials, providers taking turns.
"""

import argparse
import contextlib
import dataclasses
import pathlib
import statistics
import time

import torch

import tritonblas_ops
from benchmarks import results, sm_hog

SHAPES = [(8192, 8192, 8192), (8192, 14336, 4096)]
HELD = [8, 16, 33]
PROVIDERS = ["torch_mm", "torch_mm_carveout", "ws", "ws_live", "idle"]
WRITES = {"ws_live", "idle"}  # providers whose late side writes the budget first
# A trial takes milliseconds: waiting longer than this for its streams is a stall, reported
# with the setting that stalled instead of hanging the run (two full runs did: RESULTS.md).
TRIAL_TIMEOUT_S = 20.0
REQUEST_US = 200.0
HOLD_US = 100.0
TRIALS = 7


@dataclasses.dataclass
class HandoffRow(results.RunFields):
    shape: str
    provider: str
    held_sms: int
    priority: str  # of the late kernel's stream: normal | high
    request_us: float  # when the request came, from the GEMM's start (median)
    wait_us: float  # from the request until the late kernel's last block had an SM (median)
    wait_max_us: float
    gemm_ms: float | None  # the GEMM's time beside the late kernel (median); idle: None
    gemm_alone_ms: float | None  # the GEMM's time with nothing beside it (median); idle: None
    write_us: float | None  # from the request until the budget's write was done (median)


def _finish(streams, label: str) -> None:
    """Wait for the work queued so far on `streams`, at most TRIAL_TIMEOUT_S."""
    events = []
    for stream in streams:
        events.append(torch.cuda.Event())
        events[-1].record(stream)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while not all(event.query() for event in events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"handoff: {label}: the GPU work did not finish within {TRIAL_TIMEOUT_S} s")
        time.sleep(1e-4)


def _spin_us(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def trial(gemm, hog: sm_hog.Hog, live, programs: int, *, with_late: bool, label: str) -> tuple:
    """(request offset us, wait us, write us, GEMM ms) of one trial: the first three None
    without a late kernel, write us None without a budget (`live`), GEMM ms None without one."""
    main, late = torch.cuda.current_stream(), hog.stream
    torch.cuda.synchronize()
    g0, g1, r0, w1, r1 = (torch.cuda.Event(enable_timing=True) for _ in range(5))
    g0.record(main)
    if gemm is not None:
        gemm()
    g1.record(main)
    if not with_late:
        _finish([main], f"{label}, alone")
        return None, None, None, g0.elapsed_time(g1) if gemm is not None else None
    _spin_us(REQUEST_US)
    # Between r0 and r1: the write and the launch, nothing the host could have done before.
    r0.record(late)
    if live is not None:
        live.lower(programs, late)
        w1.record(late)
    hold = hog.launch(HOLD_US / 1e3)
    r1.record(late)
    if live is not None:
        live.restore(late)
    _finish([main, late], f"{label}, with the late kernel")
    hold.check_distinct_sms()
    write_us = r0.elapsed_time(w1) * 1e3 if live is not None else None
    gemm_ms = g0.elapsed_time(g1) if gemm is not None else None
    return g0.elapsed_time(r0) * 1e3, r0.elapsed_time(r1) * 1e3 - HOLD_US, write_us, gemm_ms


def measure(shape, held: int, priority: str, args) -> list:
    m, n, k = shape
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    late = torch.cuda.Stream(priority=-1 if priority == "high" else 0)
    live = tritonblas_ops.LiveBudget()
    programs = torch.cuda.get_device_properties(live.device).multi_processor_count - held
    hog = sm_hog.Hog(held, late)
    # Outside the timed windows: the hog's compile, and the pinned host words of the writes.
    hog.launch(HOLD_US / 1e3).check_distinct_sms()
    live.lower(programs, late)
    live.restore(late)
    _finish([late], f"{m}x{n}x{k}, H = {held}, the budget's first writes")
    gemms = {"torch_mm": lambda: torch.mm(a, b), "torch_mm_carveout": lambda: torch.mm(a, b),
             "ws": lambda: torch.ops.tritonblas.ws_mm(a, b), "ws_live": lambda: torch.ops.tritonblas.ws_mm(a, b),
             "idle": None}
    samples = {p: [] for p in args.providers}
    alone = {p: [] for p in args.providers}
    for t in range(args.trials + 1):  # the first: compiles and warms up, dropped
        for p in args.providers[t % len(args.providers):] + args.providers[:t % len(args.providers)]:
            carveout = p == "torch_mm_carveout"
            if carveout:
                torch._C._set_sm_carveout_experimental(held)
            writer = live if p in WRITES else None
            try:
                with live if p == "ws_live" else contextlib.nullcontext():
                    label = f"{m}x{n}x{k}, {p}, H = {held}, {priority} priority, trial {t}"
                    alone_ms = trial(gemms[p], hog, None, programs, with_late=False, label=label)[3]
                    sample = trial(gemms[p], hog, writer, programs, with_late=True, label=label)
            finally:
                if carveout:
                    torch._C._set_sm_carveout_experimental(None)
            if t:
                samples[p].append(sample)
                alone[p].append(alone_ms)
    return summarize(f"{m}x{n}x{k}", held, priority, samples, alone)


def _median(values):
    """None if any is None (a provider without that part)."""
    return None if None in values else statistics.median(values)


def summarize(shape: str, held: int, priority: str, samples: dict, alone: dict) -> list[dict]:
    """HandoffRow fields (less the run's) per provider, from its trials' (request us, wait us,
    write us, GEMM ms) and GEMM-alone ms."""
    rows = []
    for p, s in samples.items():
        request, wait, write, gemm_ms = zip(*s)
        rows.append(dict(shape=shape, provider=p, held_sms=held, priority=priority,
                         request_us=statistics.median(request), wait_us=statistics.median(wait),
                         wait_max_us=max(wait), gemm_ms=_median(gemm_ms),
                         gemm_alone_ms=_median(alone[p]), write_us=_median(write)))
    return rows


def table(rows: list) -> str:
    def num(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"{'shape':<18}{'provider':<19}{'held':>5} {'priority':<8}{'request us':>11}{'write us':>9}"
             f"{'wait us':>9}{'max':>8}{'GEMM ms':>9}{'alone':>8}"]
    for r in rows:
        lines.append(f"{r.shape:<18}{r.provider:<19}{r.held_sms:>5} {r.priority:<8}{r.request_us:>11.0f}"
                     f"{num(r.write_us, '.0f'):>9}{r.wait_us:>9.0f}{r.wait_max_us:>8.0f}"
                     f"{num(r.gemm_ms, '.3f'):>9}{num(r.gemm_alone_ms, '.3f'):>8}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", type=lambda s: [int(x) for x in s.split(",")], default=HELD)
    parser.add_argument("--providers", type=lambda s: s.split(","), default=PROVIDERS)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/h200_handoff.csv"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"unknown providers {unknown}; known: {PROVIDERS}")
    results.check_columns(args.out, HandoffRow)  # before the run, not after it
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.handoff needs a CUDA GPU")
    torch.manual_seed(0)
    env = results.environment(torch.device("cuda"), vars(args))
    env.update(request_us=REQUEST_US, hold_us=HOLD_US)
    rows = []
    for shape in SHAPES:
        for held in args.held:
            for priority in ("normal", "high"):
                rows += [HandoffRow(**results.run_fields(env), **r) for r in measure(shape, held, priority, args)]
    print(table(rows))
    results.append(args.out, rows, env)
    print(f"appended {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()

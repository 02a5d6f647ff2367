"""SMs handed to a kernel launched while a GEMM runs (issue "SMs on demand", part 1).

    python -m benchmarks.handoff --out benchmarks/results/h200_handoff.csv

A GEMM is queued on one stream; REQUEST_US later (host time) another stream asks for H
whole SMs: sm_hog's kernel, H blocks that each take a whole SM and spin for HOLD_US, on a
stream of normal or of high priority. The late kernel's wait is the time from its request
(an event recorded on its stream right before it, and before the budget's write) to its
end, less HOLD_US: when its last block got an SM. The GEMM's time is events around it.
Providers:
  torch_mm           cuBLAS
  torch_mm_carveout  cuBLAS with torch's SM carve-out set to H before the GEMM launches
  ws                 ws_mm, no live budget: the late kernel waits for programs to finish
  ws_live            ws_mm under a LiveBudget, lowered to SMs - H on the late stream (a
                     4-byte copy) right before the late kernel
Each row: the median of TRIALS trials, providers taking turns.
"""

import argparse
import dataclasses
import pathlib
import statistics
import time

import torch

import tritonblas_ops
from benchmarks import results, sm_hog

SHAPES = [(8192, 8192, 8192), (8192, 14336, 4096)]
HELD = [8, 16, 33]
PROVIDERS = ["torch_mm", "torch_mm_carveout", "ws", "ws_live"]
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
    gemm_ms: float  # the GEMM's time beside the late kernel (median)
    gemm_alone_ms: float  # the GEMM's time with nothing beside it (median)


def _spin_us(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def trial(gemm, held: int, late: torch.cuda.Stream, live, *, with_late: bool) -> tuple:
    """(request offset us, wait us, GEMM ms) of one trial; the first two None without a late kernel."""
    main = torch.cuda.current_stream()
    torch.cuda.synchronize()
    g0, g1, r0, r1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    g0.record(main)
    gemm()
    g1.record(main)
    if not with_late:
        g1.synchronize()
        return None, None, g0.elapsed_time(g1)
    _spin_us(REQUEST_US)
    with torch.cuda.stream(late):
        r0.record(late)
        if live is not None:
            live.lower(torch.cuda.get_device_properties(live.device).multi_processor_count - held, late)
        hold = sm_hog.hold_sms(held, HOLD_US / 1e3, late)
        r1.record(late)
        if live is not None:
            live.restore(late)
    torch.cuda.synchronize()
    hold.check_distinct_sms()
    return g0.elapsed_time(r0) * 1e3, r0.elapsed_time(r1) * 1e3 - HOLD_US, g0.elapsed_time(g1)


def measure(shape, held: int, priority: str, args) -> list:
    m, n, k = shape
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    late = torch.cuda.Stream(priority=-1 if priority == "high" else 0)
    live = tritonblas_ops.LiveBudget()
    gemms = {"torch_mm": lambda: torch.mm(a, b), "torch_mm_carveout": lambda: torch.mm(a, b),
             "ws": lambda: torch.ops.tritonblas.ws_mm(a, b), "ws_live": lambda: torch.ops.tritonblas.ws_mm(a, b)}
    samples = {p: [] for p in args.providers}
    alone = {p: [] for p in args.providers}
    for t in range(args.trials + 1):  # the first: compiles and warms up, dropped
        for p in args.providers[t % len(args.providers):] + args.providers[:t % len(args.providers)]:
            carveout = p == "torch_mm_carveout"
            if carveout:
                torch._C._set_sm_carveout_experimental(held)
            try:
                if p == "ws_live":
                    with live:
                        alone_ms = trial(gemms[p], held, late, None, with_late=False)[2]
                        sample = trial(gemms[p], held, late, live, with_late=True)
                else:
                    alone_ms = trial(gemms[p], held, late, None, with_late=False)[2]
                    sample = trial(gemms[p], held, late, None, with_late=True)
            finally:
                if carveout:
                    torch._C._set_sm_carveout_experimental(None)
            if t:
                samples[p].append(sample)
                alone[p].append(alone_ms)
    rows = []
    for p, s in samples.items():
        request, wait, gemm_ms = zip(*s)
        rows.append(dict(shape=f"{m}x{n}x{k}", provider=p, held_sms=held, priority=priority,
                         request_us=statistics.median(request), wait_us=statistics.median(wait),
                         wait_max_us=max(wait), gemm_ms=statistics.median(gemm_ms),
                         gemm_alone_ms=statistics.median(alone[p])))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", type=lambda s: [int(x) for x in s.split(",")], default=HELD)
    parser.add_argument("--providers", type=lambda s: s.split(","), default=PROVIDERS)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/h200_handoff.csv"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    env = results.environment(torch.device("cuda"), vars(args))
    env.update(request_us=REQUEST_US, hold_us=HOLD_US)
    rows = []
    for shape in SHAPES:
        for held in args.held:
            for priority in ("normal", "high"):
                rows += [HandoffRow(**results.run_fields(env), **r) for r in measure(shape, held, priority, args)]
    print(f"{'shape':<18}{'provider':<19}{'held':>5} {'priority':<8}{'request us':>11}{'wait us':>9}"
          f"{'max':>8}{'GEMM ms':>9}{'alone':>8}")
    for r in rows:
        print(f"{r.shape:<18}{r.provider:<19}{r.held_sms:>5} {r.priority:<8}{r.request_us:>11.0f}"
              f"{r.wait_us:>9.0f}{r.wait_max_us:>8.0f}{r.gemm_ms:>9.3f}{r.gemm_alone_ms:>8.3f}")
    results.append(args.out, rows, env)
    print(f"appended {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()

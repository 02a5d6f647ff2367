"""A GEMM overlapped with an all-reduce on another stream (issue 8; METHOD.md, "Overlap").

    python -m benchmarks.overlap --hog-sms 16,33 --out benchmarks/results/h200_overlap.csv
    torchrun --nproc-per-node 2 -m benchmarks.overlap --out benchmarks/results/h200x2_overlap.csv

Modes: `allreduce` (several processes, NCCL, one per GPU; all ranks run the same trials,
rank 0 reports its own times) and `hog` (one process, or --hog-sms given): sm_hog's kernel
holds H SMs for about as long as the all-reduce would take, in its place.
Per shape and provider, three cases take turns in each repetition: the communication alone,
the GEMM alone, both. A trial: a delay kernel holds everything back until the host has
queued it all (host launch time stays out); from a common start event the communication
runs on one stream and, HEAD_START_MS later, the GEMM on another, as when a collective is
issued before the compute that hides it (issued after, it would wait for a persistent
GEMM's SMs until the GEMM ended). CUDA events time start to both done and each side's own
time inside that. --smoke: CPU, gloo, Triton interpreter, tiny shapes, one side after the other.
"""

import argparse
import os
import pathlib
import shlex
import sys
import time

import torch
import torch.distributed as dist

from benchmarks import contention, corpus, measure, results, sm_hog
from benchmarks.providers import providers

# NVLink multicast (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS) stays off: on shared
# hosts it can put the GPUs out of service. Forced, not setdefault: an inherited "1" must lose.
# They are read when a communicator is created, so setting them at import is early enough.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

DTYPE = torch.bfloat16
SHAPES = "8192x8192x8192,4096x14336x4096"
HOG_SMS = [16]  # one process without --hog-sms: a guess at the SMs NCCL's ring kernel occupies
BUS_GBPS = 360.0  # assumed NCCL bus bandwidth, two H200s over NVLink without NVLS: the hog's time
HEAD_START_MS = 0.05  # lets the communication's blocks take their SMs before the GEMM's arrive
WARMUP = 2  # repetitions dropped: compiles, NCCL setup, first allocations
ATTEMPTS = 4
# A results.Row's `group` says what was timed; its `mode`, beside what (allreduce or hog).
# (case, time) -> group; a case is "comm", a provider alone, or a provider + "+comm".
GROUPS = {("", "gemm"): "gemm", ("+comm", "wall"): "overlap", ("+comm", "gemm"): "gemm_in_overlap",
          ("+comm", "comm"): "comm_in_overlap"}


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.manual_seed(0)
    device = _init_distributed(args.smoke)
    world, rank = dist.get_world_size(), dist.get_rank()
    mode = "allreduce" if args.smoke or (world > 1 and not args.hog_sms) else "hog"
    hog_ms = args.hog_ms or _allreduce_ms(args.allreduce_mb, world)
    env = results.environment(device, vars(args))
    env.update(command=shlex.join([sys.executable, "-m", "benchmarks.overlap", *sys.argv[1:]]),
               world_size=world, mode=mode, hog_ms=hog_ms if mode == "hog" else None)
    streams = [torch.cuda.Stream() for _ in range(3)] if device.type == "cuda" else None
    rows = []
    for shape in corpus.SMOKE if args.smoke and not args.shapes else corpus.parse_shapes(args.shapes or SHAPES):
        a = torch.randn(shape.m, shape.k, dtype=DTYPE, device=device)
        b = torch.randn(shape.k, shape.n, dtype=DTYPE, device=device)
        provs = providers(device, shards=None, inductor=False)
        checked = {p.name: _checked(p, a, b, shape) for p in provs}
        for held, comm in _comms(mode, args, hog_ms, device):
            cases = {"comm": (None, comm)}
            for p in provs:
                cases[p.name], cases[p.name + "+comm"] = (checked[p.name][0], None), (checked[p.name][0], comm)
            samples = _measure(cases, args.reps, streams, device)
            rows += _rows(env, shape, held, provs, checked, samples)
    if rank == 0:
        print(f"{env['gpu']} x {world}, torch {env['torch']}, triton {env['triton']}, {env['timestamp']}")
        print(table(rows, env))
        if args.out:
            results.append(args.out, rows, env)
            print(f"appended {len(rows)} rows to {args.out}")
    dist.destroy_process_group()


def _init_distributed(smoke: bool) -> torch.device:
    """One process per GPU under torchrun; otherwise a one-rank group, so one code path."""
    if smoke:
        device, kwargs = torch.device("cpu"), {}
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        kwargs = {"device_id": device}
    if "WORLD_SIZE" not in os.environ:  # not started by torchrun
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group("gloo" if smoke else "nccl", **kwargs)
    return device


def _allreduce_ms(mib: float, world: int) -> float:
    """A ring all-reduce moves 2(n-1)/n of the buffer over each GPU's links (n >= 2: the hog
    stands in for an all-reduce between GPUs)."""
    n = max(world, 2)
    return 2 * (n - 1) / n * mib * 2**20 / (BUS_GBPS * 1e9) * 1e3


def _comms(mode, args, hog_ms, device):
    """(held SMs, a call that starts the communication on the current stream), per config."""
    if mode == "allreduce":
        # Zeros: the sum stays zero however often it runs (NCCL's speed ignores the values).
        buf = torch.zeros(int(args.allreduce_mb * 2**20) // DTYPE.itemsize, dtype=DTYPE, device=device)
        return [(None, lambda: dist.all_reduce(buf, async_op=True).wait())]  # on a GPU: a stream wait
    return [(held, lambda held=held: sm_hog.hold_sms(held, hog_ms)) for held in args.hog_sms or HOG_SMS]


def _checked(prov, a, b, shape):
    """(call, relative error): the provider first passes the harness's float64 gate (measure.py)."""
    call = prov.prepare(a, b)
    call()  # compiles
    rows = measure.reference_rows(shape.m)
    ref = measure.matmul_ref(a, b, rows)
    measure.poison_allocator(shape.m * shape.n, DTYPE, a.device)
    return call, measure.check(call(), ref, rows, measure.TOLERANCE[DTYPE], f"{prov.name} on {shape.name}")


def _measure(cases, reps, streams, device):
    """{case: {time: [ms per trial]}}; cases take turns, so slow drifts (clocks, heat) hit all alike."""
    samples = {name: {} for name in cases}
    for rep in range(WARMUP + reps):
        for name, (gemm, comm) in cases.items():
            queue_ms = []
            for _ in range(ATTEMPTS):
                times, clean, queued_ms = _gpu_trial(gemm, comm, streams) if streams else _cpu_trial(gemm, comm)
                queue_ms.append(queued_ms)
                # Ranks keep or redo a trial together (their all-reduces pair up); this
                # collective also lines up the ranks' next trials.
                flag = torch.tensor([int(clean)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if flag.item():
                    break
            else:
                # Host times well under the delay would mean the delay kernel ended early.
                raise RuntimeError(f"{name}: queuing a trial took the host over {contention.DELAY_MS} ms, "
                                   f"{ATTEMPTS} times in a row (host times "
                                   f"{', '.join(f'{ms:.2f}' for ms in queue_ms)} ms)")
            if rep >= WARMUP:
                for key, ms in times.items():
                    samples[name].setdefault(key, []).append(ms)
    return samples


def _gpu_trial(gemm, comm, streams):
    main_stream, comm_stream, gemm_stream = streams
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "go", "comm", "gemm", "done")}
    begin = time.perf_counter()
    with torch.cuda.stream(main_stream):
        delay = sm_hog.hold_sms(1, contention.DELAY_MS)
        ev["start"].record()
        sm_hog.hold_sms(1, HEAD_START_MS)
        ev["go"].record()
    waits_for = {"comm": "start", "gemm": "go"}
    launched = {}
    for key, fn, stream in (("comm", comm, comm_stream), ("gemm", gemm, gemm_stream)):
        if fn:
            stream.wait_event(ev[waits_for[key]])
            with torch.cuda.stream(stream):
                launched[key] = fn()
                ev[key].record()
            main_stream.wait_event(ev[key])
    ev["done"].record(main_stream)
    queued_ms = (time.perf_counter() - begin) * 1e3
    queued_in_time = delay.active()
    ev["done"].synchronize()
    if isinstance(launched.get("comm"), sm_hog.Hold):
        launched["comm"].check_distinct_sms()
    times = {key: ev[waits_for[key]].elapsed_time(ev[key]) for key in launched}
    return {"wall": ev["start"].elapsed_time(ev["done"]), **times}, queued_in_time, queued_ms


def _cpu_trial(gemm, comm):
    times, start = {}, time.perf_counter()
    for key, fn in (("comm", comm), ("gemm", gemm)):
        if fn:
            begin = time.perf_counter()
            fn()
            times[key] = (time.perf_counter() - begin) * 1e3
    wall_ms = (time.perf_counter() - start) * 1e3
    return {"wall": wall_ms, **times}, True, wall_ms


def _rows(env, shape, held, provs, checked, samples) -> list[results.Row]:
    def row(group, provider, case, key, num_shards=None, error=None):
        p20, p50, p80 = measure.quantiles(samples[case][key])
        return results.row(env, mode=env["mode"], dtype=str(DTYPE).removeprefix("torch."), group=group,
                           shape=shape.name, m=shape.m, n=shape.n, k=shape.k, provider=provider,
                           num_shards=num_shards, held_sms=held, gemms_per_window=None, p20_ms=p20,
                           p50_ms=p50, p80_ms=p80, rel_err=error,
                           tflops=shape.flops / (p50 * 1e-3) / 1e12 if key == "gemm" else None)

    rows = [row("comm", env["mode"], "comm", "comm")]
    for p in provs:
        rows += [row(group, p.name, p.name + suffix, key, p.num_shards, checked[p.name][1])
                 for (suffix, key), group in GROUPS.items()]
    return rows


def table(rows: list[results.Row], env: dict) -> str:
    ms = {(r.shape, r.held_sms, r.provider, r.group): r.p50_ms for r in rows}
    args = env["args"]
    lines = []
    for shape, held in dict.fromkeys((r.shape, r.held_sms) for r in rows):
        comm = ms[shape, held, env["mode"], "comm"]
        what = (f"{held} SMs held for {env['hog_ms']:.3g} ms" if env["mode"] == "hog"
                else f"a {args['allreduce_mb']:g} MiB all-reduce over {env['world_size']} ranks")
        lines += [f"{shape} with {what} (ms, medians of {args['reps']} trials)",
                  f"{'provider':<10}{'gemm':>8}{'comm':>8}{'overlap':>9}{'gemm in':>9}{'comm in':>9}{'hidden':>8}"]
        for p in dict.fromkeys(r.provider for r in rows if r.group == "gemm"):
            gemm, wall, gemm_in, comm_in = (ms[shape, held, p, g] for g in GROUPS.values())  # GROUPS' order
            possible = gemm + comm - max(comm, HEAD_START_MS + gemm)  # serial minus the best case
            hidden = f"{(gemm + comm - wall) / possible:.2f}" if possible > 0 else "-"
            lines.append(f"{p:<10}{gemm:>8.3f}{comm:>8.3f}{wall:>9.3f}{gemm_in:>9.3f}{comm_in:>9.3f}{hidden:>8}")
        lines.append("")
    lines.append("hidden = (gemm + comm - overlap) / (gemm + comm - max(comm, head start + gemm)): "
                 "1 = both as fast as alone, 0 = serialized")
    return "\n".join(lines)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", metavar="MxNxK,...", help=f"default {SHAPES}")
    parser.add_argument("--allreduce-mb", type=float, default=256.0, help="all-reduce size in MiB (bf16)")
    parser.add_argument("--hog-sms", type=lambda s: [int(x) for x in s.split(",")], metavar="H,H,...",
                        help=f"hog mode, one config per H (default with one process: {HOG_SMS})")
    parser.add_argument("--hog-ms", type=float, help="how long the hog holds its SMs "
                        f"(default: the all-reduce's time at {BUS_GBPS:g} GB/s bus bandwidth)")
    parser.add_argument("--reps", type=int, default=20, help="timed trials per case")
    parser.add_argument("--out", type=pathlib.Path, help="CSV to append rows to (metadata to the .json beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    if args.smoke and args.hog_sms:
        parser.error("--hog-sms needs a CUDA GPU; --smoke runs on the CPU")
    if args.smoke:
        args.reps, args.allreduce_mb = min(args.reps, 3), min(args.allreduce_mb, 1.0)
    return args


if __name__ == "__main__":
    main()

"""This tree against another checkout of tritonblas_ops: host time per eager call and the
output bits, in alternating processes of one machine (host speed drifts between machine
starts, so only a side-by-side run compares host time).

    git archive <commit> tritonblas_ops | tar -x -C /some/dir
    python -m benchmarks.ab --baseline /some/dir [--rounds 6] [--fast-paths-off]

Each round runs one process per tree (baseline, this; with --fast-paths-off also this
tree with TRITONBLAS_OPS_FAST_PATHS=0), in turn. A process times torch.mm, the op and the
Python entry point on a 64^3 bf16 GEMM (as --overhead does) and, in the first round,
computes a fixed set of seeded GEMMs whose outputs the trees must agree on bit for bit.
Prints per-call microseconds (median over rounds of each process's median) and the bits
verdict; exits 1 if any output differs.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent

PROCESS = r"""
import json, sys, time
import torch
import tritonblas_ops

out_path, calls, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
device, dtype = "cuda", torch.bfloat16
a = torch.randn(64, 64, device=device, dtype=dtype)
b = torch.randn(64, 64, device=device, dtype=dtype)
providers = {"torch_mm": torch.mm, "ws_op": torch.ops.tritonblas.ws_mm, "ws": tritonblas_ops.ws_matmul}
for fn in providers.values():
    for _ in range(50):
        fn(a, b)
torch.cuda.synchronize()
samples = {name: [] for name in providers}
for _ in range(trials):
    for name, fn in providers.items():
        start = time.perf_counter()
        for _ in range(calls):
            fn(a, b)
        torch.cuda.synchronize()
        samples[name].append((time.perf_counter() - start) / calls * 1e6)
result = {name: sorted(times)[len(times) // 2] for name, times in samples.items()}

if out_path != "-":
    g = torch.Generator(device=device).manual_seed(0)
    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g, device=device).to(dtype)
    outs = {}
    for m, n, k in [(4096, 4096, 4096), (3000, 5000, 2000), (5, 4000, 4096), (256, 512, 32768),
                    (999, 777, 555), (2049, 1023, 777), (1, 14336, 4096), (1000, 1000, 1000)]:
        x, w, bias = randn(m, k), randn(k, n), randn(n)
        outs[f"mm {m} {n} {k}"] = torch.ops.tritonblas.ws_mm(x, w)
        outs[f"mm col-major {m} {n} {k}"] = torch.ops.tritonblas.ws_mm(x.t().contiguous().t(), w)
        outs[f"addmm {m} {n} {k}"] = torch.ops.tritonblas.ws_addmm(bias, x, w, beta=0.5, alpha=0.1)
        outs[f"fp16 {m} {n} {k}"] = torch.ops.tritonblas.ws_mm(x.half(), w.half())
        outs[f"bmm {m} {n} {k}"] = torch.ops.tritonblas.ws_bmm(randn(2, m, k), randn(2, k, n))
    torch.save({name: t.cpu() for name, t in outs.items()}, out_path)
print(json.dumps(result))
"""


def run_process(tree: pathlib.Path, out_path: str, calls: int, trials: int, fast_paths: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TRITONBLAS_OPS_FAST_PATHS": "1" if fast_paths else "0"}
    proc = subprocess.run([sys.executable, "-c", PROCESS, out_path, str(calls), str(trials)],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=pathlib.Path, required=True,
                        help="a folder holding another tritonblas_ops package")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed trial")
    parser.add_argument("--trials", type=int, default=11)
    parser.add_argument("--fast-paths-off", action="store_true",
                        help="also this tree with TRITONBLAS_OPS_FAST_PATHS=0")
    parser.add_argument("--host-only", action="store_true", help="time only; compare no bits")
    parser.add_argument("--out", type=pathlib.Path, help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    import torch  # noqa: F401  (only to fail early without one)

    variants = {"baseline": (args.baseline.resolve(), True), "this tree": (REPO, True)}
    if args.fast_paths_off:
        variants["this tree, fast paths off"] = (REPO, False)
    times = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        outputs = {name: os.path.join(folder, f"{i}.pt") for i, name in enumerate(variants)}
        for round_ in range(args.rounds):
            # ABBA order: a drift in host speed over the run falls on every tree alike
            order = list(variants.items()) if round_ % 2 == 0 else list(variants.items())[::-1]
            for name, (tree, fast) in order:
                out_path = outputs[name] if round_ == 0 and not args.host_only else "-"
                times[name].append(run_process(tree, out_path, args.calls, args.trials, fast))
                print(f"round {round_ + 1} {name}: {times[name][-1]}", flush=True)
        bits = {name: torch.load(path) for name, path in outputs.items()} if not args.host_only else {}
    reference = bits.get("baseline", {})
    differing = {name: [key for key in reference if not torch.equal(reference[key], outs[key])]
                 for name, outs in bits.items() if name != "baseline"}

    # Host speed differs between processes by up to 1.5x (one machine, one minute apart), so
    # each process's own op - mm is the comparable number; its median and range are printed.
    for runs in times.values():
        for run in runs:
            run["op - mm"] = run["ws_op"] - run["torch_mm"]
    providers = list(times["baseline"][0])
    summary = {name: {p: statistics.median(run[p] for run in runs) for p in providers}
               for name, runs in times.items()}
    print(f"\nus per call, 64^3 bf16, median of {args.rounds} processes x {args.trials} trials "
          f"x {args.calls} calls; op - mm: median [min, max] of the processes' own")
    print(f"{'':<28}" + "".join(f"{p:>10}" for p in providers))
    for name, row in summary.items():
        spread = [run["op - mm"] for run in times[name]]
        print(f"{name:<28}" + "".join(f"{row[p]:>10.1f}" for p in providers)
              + f"  [{min(spread):.1f}, {max(spread):.1f}]")
    for name, keys in differing.items() if bits else ():
        print(f"bits, {name} vs baseline: {'equal' if not keys else 'DIFFER: ' + ', '.join(keys)} "
              f"({len(reference)} outputs)")
    if args.out:
        args.out.write_text(json.dumps({"times": times, "summary": summary, "differing": differing},
                                       indent=1))
    return 1 if any(differing.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

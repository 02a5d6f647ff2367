"""Work-stealing GEMM against torch.mm (cuBLAS), the static schedule and optionally
Inductor, side by side in one process. See README.md for the commands.

Modes (one per run):
  default        every shape of --corpus (or --shapes), each provider, cold L2
  --contention   the same under another stream holding H SMs (METHOD.md)
  --overhead     host wall time of one eager call on a 64^3 GEMM
--smoke runs the GEMM mode on the CPU through the Triton interpreter, to check the plumbing.
"""

import argparse
import pathlib

import torch
from triton.runtime.errors import OutOfResources

import tritonblas_ops

from benchmarks import contention, corpus, measure, overhead, report, results
from benchmarks.providers import parse_config, providers

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is a nicety; a CPU machine need not install tqdm
    def tqdm(iterable, **_):
        return iterable

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROW_MAJOR, K_MAJOR = "row-major", "k-major"


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.manual_seed(0)
    if args.batch_invariant:
        tritonblas_ops.batch_invariant(True)
    args.batch_invariant = tritonblas_ops.is_batch_invariant()  # the environment's, too: in the metadata
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32 and device.type == "cuda":
        _use_tf32()
    env = results.environment(device, vars(args))
    sms = f" ({env['num_sms']} SMs)" if env["num_sms"] else ""
    print(f"{env['gpu']}{sms}, torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}, {env['timestamp']}")

    if args.overhead:
        rows = _run_overhead(env, dtype, device, smoke=args.smoke)
        tabulate = report.overhead_table
    else:
        provs = providers(device, shards=args.shards, inductor=args.inductor, configs=args.configs,
                          triton_kernel=args.triton_kernel)
        shapes = _shapes(args)
        if args.contention is not None:
            rows = _run_contention(env, shapes, provs, args.contention, dtype, device, args)
            tabulate = report.contention_table
        else:
            rows = _run_gemms(env, shapes, provs, dtype, device, args)
            tabulate = report.gemm_table
    results.fill_ratios(rows)
    print(tabulate(rows))
    if args.out:
        results.append(args.out, rows, env)
        print(f"appended {len(rows)} rows to {args.out}")


def _run_gemms(env, shapes, provs, dtype, device, args) -> list[results.Row]:
    rows = []
    for shape in tqdm(shapes, unit="shape"):
        a, b, check_rows, ref = _inputs(shape, dtype, device, args.b_layout)
        verified = {}
        for prov in provs:
            try:
                verified[prov.name] = prov, *_verified_call(prov, shape, a, b, check_rows, ref)
            except OutOfResources as exc:  # a forced --configs tile that does not fit the SM
                print(f"{prov.name} on {shape.name}: no row, {exc}")
        times = measure.time_ms({name: call for name, (_, call, _) in verified.items()}, device,
                                warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        rows += [_gemm_row(env, "gemm", shape, prov, a, times[name], error)
                 for name, (prov, _, error) in verified.items()]
    return rows


def _run_contention(env, shapes, provs, held_list, dtype, device, args) -> list[results.Row]:
    num_sms = env["num_sms"]
    if not 0 <= min(held_list) <= max(held_list) < num_sms:
        raise SystemExit(f"--contention: held SMs must lie in [0, {num_sms}), got {held_list}")
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    rows = []
    for shape in shapes:
        a, b, check_rows, ref = _inputs(shape, dtype, device, args.b_layout)
        verified = {prov.name: _verified_call(prov, shape, a, b, check_rows, ref) for prov in provs}
        unheld = measure.time_ms({name: call for name, (call, _) in verified.items()}, device,
                                 warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        calls = {name: (call, error, unheld[name][1], contention.gemms_per_window(unheld[name][1]))
                 for name, (call, error) in verified.items()}
        for held in tqdm(held_list, desc=f"{shape.name} held SMs"):
            samples = {p.name: [] for p in provs}
            # Providers take turns inside each trial, so slow drifts (clocks, heat) hit all alike.
            for _ in range(contention.TRIALS):
                for prov in provs:
                    call, _, unheld_ms, gemms = calls[prov.name]
                    samples[prov.name].append(
                        contention.held_ms_per_gemm(call, gemms, held, unheld_ms, num_sms, streams))
            for prov in provs:
                _, error, _, gemms = calls[prov.name]
                rows.append(_gemm_row(env, "contention", shape, prov, a, measure.quantiles(samples[prov.name]),
                                      error, held_sms=held, gemms_per_window=gemms))
    return rows


def _run_overhead(env, dtype, device, *, smoke: bool) -> list[results.Row]:
    size = overhead.SIZE
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    calls_per_trial, trials = (10, 3) if smoke else (1000, 21)
    per_call = overhead.us_per_call(overhead.providers(), a, b, calls_per_trial=calls_per_trial,
                                    trials=trials)
    rows = []
    for name, us in per_call.items():
        rows.append(results.row(
            env, mode="overhead", dtype=str(dtype).removeprefix("torch."), group="overhead",
            shape=f"{size}x{size}x{size}", m=size, n=size, k=size, provider=name, num_shards=None,
            held_sms=None, gemms_per_window=None, p20_ms=us[0] / 1e3, p50_ms=us[1] / 1e3, p80_ms=us[2] / 1e3))
    return rows


def _inputs(shape, dtype, device, b_layout=ROW_MAJOR):
    """Operands, the output rows to check and their float64 reference (computed once per shape).
    B is row-major, or K-major: the transpose of a row-major (N, K) tensor, as nn.Linear
    passes its weight."""
    a = torch.randn(shape.m, shape.k, dtype=dtype, device=device)
    if b_layout == K_MAJOR:
        b = torch.randn(shape.n, shape.k, dtype=dtype, device=device).mT
    else:
        b = torch.randn(shape.k, shape.n, dtype=dtype, device=device)
    check_rows = measure.reference_rows(shape.m)
    return a, b, check_rows, measure.matmul_ref(a, b, check_rows)


def _verified_call(prov, shape, a, b, check_rows, ref):
    """The provider's call, once an output of it passed the float64 check. The first call
    compiles (and for Inductor autotunes, allocating as it goes); the checked one is next."""
    call = prov.prepare(a, b)
    call()
    measure.poison_allocator(shape.m * shape.n, a.dtype, a.device)
    what = f"{prov.name} on {shape.name} ({shape.m}x{shape.n}x{shape.k}, {a.dtype})"
    error = measure.check(call(), ref, check_rows, measure.TOLERANCE[a.dtype], what)
    return call, error


def _gemm_row(env, mode, shape, prov, a, times, error, held_sms=None, gemms_per_window=None):
    p20, p50, p80 = times
    nbytes = shape.bytes(a.element_size())
    return results.row(
        env, mode=mode, dtype=str(a.dtype).removeprefix("torch."), group=shape.group, shape=shape.name,
        m=shape.m, n=shape.n, k=shape.k, provider=prov.name, num_shards=prov.num_shards,
        held_sms=held_sms, gemms_per_window=gemms_per_window, p20_ms=p20, p50_ms=p50, p80_ms=p80,
        tflops=shape.flops / (p50 * 1e-3) / 1e12, bytes=nbytes, gbps=nbytes / (p50 * 1e-3) / 1e9,
        rel_err=error)


def _shapes(args) -> list[corpus.Shape]:
    if args.shapes:
        return corpus.parse_shapes(args.shapes)
    if args.smoke:
        return corpus.SMOKE
    if args.corpus:
        return corpus.CORPORA[args.corpus]
    if args.contention is not None:
        return corpus.parse_shapes("8192x8192x8192")  # the shape of METHOD.md's contention tables
    return corpus.FULL


def _use_tf32() -> None:
    """fp32 GEMMs run as TF32 on both sides (torch.mm and our kernel read the same flag)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--contention", type=_int_list, metavar="H,H,...",
                      help="SMs to hold on another stream, e.g. 0,8,20,33,66 (default shape 8192^3)")
    mode.add_argument("--overhead", action="store_true", help="host time per eager call, 64^3")
    parser.add_argument("--corpus", choices=sorted(corpus.CORPORA),
                        help="default: full (8192x8192x8192 alone with --contention)")
    parser.add_argument("--shapes", metavar="MxNxK,...", help="explicit shapes instead of the corpus")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--b-layout", choices=(ROW_MAJOR, K_MAJOR), default=ROW_MAJOR,
                        help="B as a row-major (K, N) tensor, or K-major: the transpose of an (N, K) "
                             "one, as nn.Linear passes its weight (TF32 then needs no copy)")
    parser.add_argument("--shards", type=_int_list, metavar="S,S,...",
                        help="work-stealing shard counts to sweep (rows ws_sS); default: the library's")
    parser.add_argument("--configs", type=lambda text: [parse_config(c) for c in text.split(",")],
                        metavar="CFG,CFG,...",
                        help="also time work stealing with these forced tile configs, e.g. "
                             "128x256x64w8s3k1,64x128x64w4s4k4,128x128x64w8s4k1c4 (rows ws_<config>; cC: K in C chunks)")
    parser.add_argument("--inductor", action="store_true", help="add Inductor max-autotune (slow: compiles per shape)")
    parser.add_argument("--triton-kernel", action="store_true",
                        help="add work stealing with the Triton kernel alone (the warp-specialized one off)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="ws and static in batch-invariant mode (tritonblas_ops.batch_invariant)")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="GPU warmup per timed provider and shape")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="GPU time spent timing each provider and shape")
    parser.add_argument("--out", type=pathlib.Path, help="CSV to append rows to (metadata to the .json beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    if args.smoke and args.contention is not None:
        parser.error("--contention needs a CUDA GPU; --smoke runs on the CPU")
    if args.smoke:
        args.rep_ms = min(args.rep_ms, 1.0)
    return args


if __name__ == "__main__":
    main()

"""Write tritonblas_ops/measured.py, the measurements routing policy "auto" predicts from,
out of the recorded corpus runs (benchmarks/results/<gpu>_<dtype>.csv), one entry per GPU:

    python -m benchmarks.policy_table

For each dtype file, every shape's median time under torch.mm and under the kernel (`mode`
gemm) from the latest run that timed that shape under both: a run of one corpus group
(`bench --corpus models`) adds and refreshes its shapes without dropping the others. The
kernel is the default one: bf16's shapes come first from the run that timed the
warp-specialized kernel (the default on sm_90 since 5cf05ac; 0abe554's `bench
--warp-specialized`, the Triton kernel elsewhere) and from the main file only where that
run lacks them. Also the run's best torch.mm bandwidth (what a pointwise
kernel the fusion removes would reach) and the eager op's host time per call (the latest
`--overhead` run). On the H100, bf16's main file comes first: its
latest full corpus (2026-12-07) timed the default kernel as it is now (the warp-specialized
kernel where it applies, split tails, FLOPS_PER_BYTE 800), the warp-specialized run of
2026-12-05 fills in; fp16 and fp32 come from the quick corpus (2026-12-07).
tests/test_benchmarks.py checks that the module matches these files.
"""

import argparse
import csv
import functools
import pathlib
import statistics

from benchmarks.providers import TORCH_MM, WORK_STEALING

RESULTS = pathlib.Path(__file__).parent / "results"
MODULE = pathlib.Path(__file__).parent.parent / "tritonblas_ops" / "measured.py"
# Per GPU, the files per dtype, each with the provider that timed the default kernel there
# (fp32's two files, B row-major and B K-major, form one table, so a prediction takes the
# worse of the two layouts; bf16: the main file's rows first, the default kernel as it is,
# then the older warp-specialized run's for the shapes it lacks), the file whose latest run
# names the device and versions, and the file of the `--overhead` runs.
GPUS = {
    "h200": dict(
        sources={
            "bfloat16": (("h200_bf16.csv", WORK_STEALING), ("h200_bf16_warp_specialized.csv", "ws_warp_specialized")),
            "float16": (("h200_fp16.csv", WORK_STEALING),),
            "float32": (("h200_fp32.csv", WORK_STEALING), ("h200_fp32_kmajor.csv", WORK_STEALING)),
        },
        device_file="h200_bf16.csv", host_file="h200_bf16.csv"),
    "h100": dict(
        sources={
            "bfloat16": (("h100_bf16.csv", WORK_STEALING), ("h100_bf16_warp_specialized.csv", "ws_warp_specialized")),
            "float16": (("h100_fp16.csv", WORK_STEALING),),
            "float32": (("h100_fp32.csv", WORK_STEALING), ("h100_fp32_kmajor.csv", WORK_STEALING)),
        },
        device_file="h100_bf16.csv", host_file="h100_bf16.csv"),
}
PREFERRED = {"bfloat16"}  # dtypes whose files are alternatives, the first one's shapes first
EAGER_OP = "ws_op"  # the overhead run's provider: the op called from Python, one call

HEADER = '''"""What routing policy "auto" predicts from: the corpus measured on each GPU (written by
`python -m benchmarks.policy_table` from benchmarks/results/; do not edit by hand).

Per GPU: the device name and SM count a run's device must have for its numbers to apply,
the versions and runs they came from, the best bandwidth torch.mm reached (GB/s), the
eager op's host time per call (us), and per dtype the shapes (M, N, K, torch.mm us,
kernel us): median times of back-to-back GEMMs."""

'''


@functools.cache  # a file read once per process (h200_bf16.csv serves several fields)
def _read(name: str) -> list[dict]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def _latest_gemm_run(rows: list[dict]) -> list[dict]:
    gemm = [r for r in rows if r["mode"] == "gemm"]
    latest = max(r["timestamp"] for r in gemm)
    return [r for r in gemm if r["timestamp"] == latest]


def _latest_per_shape(rows: list[dict], kernel: str) -> list[tuple[tuple, str]]:
    """((m, n, k, torch.mm us, kernel us), timestamp) of every shape: medians over the rows of
    the latest run that timed it under both torch.mm and the provider `kernel`."""
    times: dict[tuple, dict[str, dict[str, list[float]]]] = {}  # shape -> run -> provider -> us
    for r in rows:
        if r["mode"] == "gemm" and r["provider"] in (TORCH_MM, kernel):
            key = int(r["m"]), int(r["n"]), int(r["k"])
            run = times.setdefault(key, {}).setdefault(r["timestamp"], {})
            run.setdefault(r["provider"], []).append(float(r["p50_ms"]) * 1e3)
    shapes = []
    for key, runs in sorted(times.items()):
        complete = [stamp for stamp, t in runs.items() if TORCH_MM in t and kernel in t]
        if complete:
            stamp = max(complete)
            t = runs[stamp]
            shapes.append(((*key, round(statistics.median(t[TORCH_MM]), 2),
                            round(statistics.median(t[kernel]), 2)), stamp))
    return shapes


def _best_bandwidth(runs: list[tuple[list[dict], str]]) -> float:
    """The best GB/s torch.mm reached in the runs (a file's rows, a timestamp) the shapes come
    from: a run of a few shapes (`--corpus models`) must not lower it to what its own shapes
    reach."""
    return max(float(r["gbps"]) for rows, stamp in runs for r in rows
               if r["mode"] == "gemm" and r["provider"] == TORCH_MM and r["timestamp"] == stamp)


def _dtype_shapes(files: list[tuple[str, list[dict], str]], preferred: bool) -> tuple[list[tuple], list]:
    """A dtype's shapes from its files (name, rows, the default kernel's provider) and the
    runs used, (name, rows, timestamp) each; `preferred`: a file only adds the shapes the
    files before it lack, else every file adds all of its own."""
    shapes, runs = [], []
    for name, rows, kernel in files:
        found = _latest_per_shape(rows, kernel)
        if preferred:
            have = {shape[:3] for shape in shapes}
            found = [(shape, stamp) for shape, stamp in found if shape[:3] not in have]
        shapes += [shape for shape, _ in found]
        runs += [(name, rows, stamp) for stamp in sorted({stamp for _, stamp in found})]
    return sorted(shapes), runs


def _host_us(name: str) -> tuple[float, str]:
    """The eager op's median host time per call in the file's latest `--overhead` run, and
    that run (file and timestamp)."""
    overhead = [r for r in _read(name) if r["mode"] == "overhead" and r["provider"] == EAGER_OP]
    latest = max(r["timestamp"] for r in overhead)
    host_us = statistics.median(float(r["p50_ms"]) * 1e3 for r in overhead if r["timestamp"] == latest)
    return round(host_us, 2), f"{name} {latest} (host time)"


def table(gpu: str) -> dict:
    """The measured.py entry of one GPU's recorded runs (a key of GPUS)."""
    files = GPUS[gpu]
    runs, shapes = {}, {}
    for dtype, sources in files["sources"].items():
        shapes[dtype], runs[dtype] = _dtype_shapes([(name, _read(name), kernel) for name, kernel in sources],
                                                   dtype in PREFERRED)
    first = _latest_gemm_run(_read(files["device_file"]))[0]
    host_us, host_run = _host_us(files["host_file"])
    return {
        "device": first["gpu"],
        "num_sms": int(first["num_sms"]),
        "versions": f"torch {first['torch']}, triton {first['triton']}",
        "runs": (*(f"{name} {stamp}" for dtype_runs in runs.values() for name, _, stamp in dtype_runs), host_run),
        "bandwidth_gbps": _best_bandwidth([(rows, stamp) for _, rows, stamp in runs["bfloat16"]]),
        "host_us": host_us,
        "shapes": shapes,
    }


def module_text() -> str:
    """measured.py: one dict per GPU, one line per shape."""
    lines = [HEADER + "GPUS = ("]
    for gpu in GPUS:
        data = table(gpu)
        lines.append("    {")
        lines += [f"        {key!r}: {value!r}," for key, value in data.items() if key not in ("runs", "shapes")]
        lines += ["        'runs': (", *(f"            {run!r}," for run in data["runs"]), "        ),"]
        lines.append("        'shapes': {")
        for dtype, shapes in data["shapes"].items():
            lines.append(f"            {dtype!r}: (")
            lines += [f"                {shape!r}," for shape in shapes]
            lines.append("            ),")
        lines += ["        },", "    },"]
    lines += [")", ""]
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    MODULE.write_text(module_text())
    print(f"wrote {MODULE}")


if __name__ == "__main__":
    main()

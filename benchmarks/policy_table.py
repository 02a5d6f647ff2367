"""Write tritonblas_ops/measured.py, the measurements routing policy "auto" predicts from,
out of the recorded corpus runs (benchmarks/results/<gpu>_<dtype>.csv):

    python -m benchmarks.policy_table

For each dtype file, every shape's median time under torch.mm and under the kernel (`mode`
gemm) from the latest run that timed that shape under both: a run of one corpus group
(`bench --corpus models`) adds and refreshes its shapes without dropping the others. Also the run's best torch.mm bandwidth (what a pointwise
kernel the fusion removes would reach) and the eager op's host time per call (the latest
`--overhead` run). tests/test_benchmarks.py checks that the module matches these files.
"""

import argparse
import csv
import pathlib
import statistics

from benchmarks.providers import TORCH_MM, WORK_STEALING

RESULTS = pathlib.Path(__file__).parent / "results"
MODULE = pathlib.Path(__file__).parent.parent / "tritonblas_ops" / "measured.py"
# (file, dtype) per table; fp32's two files (B row-major, B K-major) form one table, so a
# prediction takes the worse of the two layouts.
SOURCES = {
    "bfloat16": ("h200_bf16.csv",),
    "float16": ("h200_fp16.csv",),
    "float32": ("h200_fp32.csv", "h200_fp32_kmajor.csv"),
}
HOST_SOURCE = "h200_bf16.csv"
EAGER_OP = "ws_op"  # the overhead run's provider: the op called from Python, one call

HEADER = '''"""What routing policy "auto" predicts from: the corpus measured on each GPU (written by
`python -m benchmarks.policy_table` from benchmarks/results/; do not edit by hand).

Per GPU: the device name and SM count a run's device must have for its numbers to apply,
the versions and runs they came from, the best bandwidth torch.mm reached (GB/s), the
eager op's host time per call (us), and per dtype the shapes (M, N, K, torch.mm us,
kernel us): median times of back-to-back GEMMs."""

'''


def _read(name: str) -> list[dict]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def _latest_gemm_run(rows: list[dict]) -> list[dict]:
    gemm = [r for r in rows if r["mode"] == "gemm"]
    latest = max(r["timestamp"] for r in gemm)
    return [r for r in gemm if r["timestamp"] == latest]


def _latest_per_shape(rows: list[dict]) -> tuple[list[tuple], list[str]]:
    """(m, n, k, torch.mm us, kernel us) of every shape, medians over the rows of the latest
    run that timed it under both, and the timestamps of the runs used, oldest first."""
    times: dict[tuple, dict[str, dict[str, list[float]]]] = {}  # shape -> run -> provider -> us
    for r in rows:
        if r["mode"] == "gemm" and r["provider"] in (TORCH_MM, WORK_STEALING):
            key = int(r["m"]), int(r["n"]), int(r["k"])
            run = times.setdefault(key, {}).setdefault(r["timestamp"], {})
            run.setdefault(r["provider"], []).append(float(r["p50_ms"]) * 1e3)
    shapes, used = [], set()
    for key, runs in sorted(times.items()):
        complete = [stamp for stamp, t in runs.items() if TORCH_MM in t and WORK_STEALING in t]
        if complete:
            stamp = max(complete)
            t = runs[stamp]
            used.add(stamp)
            shapes.append((*key, round(statistics.median(t[TORCH_MM]), 2),
                           round(statistics.median(t[WORK_STEALING]), 2)))
    return shapes, sorted(used)


def _best_bandwidth(rows: list[dict], stamps: list[str]) -> float:
    """The best GB/s torch.mm reached in the runs the shapes come from: a run of a few shapes
    (`--corpus models`) must not lower it to what its own shapes reach."""
    return max(float(r["gbps"]) for r in rows
               if r["mode"] == "gemm" and r["provider"] == TORCH_MM and r["timestamp"] in stamps)


def _host_us(rows: list[dict]) -> float:
    overhead = [r for r in rows if r["mode"] == "overhead" and r["provider"] == EAGER_OP]
    latest = max(r["timestamp"] for r in overhead)
    return round(statistics.median(float(r["p50_ms"]) * 1e3 for r in overhead if r["timestamp"] == latest), 2)


def table() -> dict:
    """The measured.py data of the recorded H200 runs."""
    runs, shapes = [], {}
    for dtype, files in SOURCES.items():
        shapes[dtype] = []
        for name in files:
            file_shapes, stamps = _latest_per_shape(_read(name))
            runs += [f"{name} {stamp}" for stamp in stamps]
            shapes[dtype] += file_shapes
        shapes[dtype].sort()
    bf16_rows = _read(SOURCES["bfloat16"][0])
    first = _latest_gemm_run(bf16_rows)[0]
    return {
        "device": first["gpu"],
        "num_sms": int(first["num_sms"]),
        "versions": f"torch {first['torch']}, triton {first['triton']}",
        "runs": tuple(runs),
        "bandwidth_gbps": _best_bandwidth(bf16_rows, _latest_per_shape(bf16_rows)[1]),
        "host_us": _host_us(_read(HOST_SOURCE)),
        "shapes": shapes,
    }


def module_text() -> str:
    """measured.py: one dict per GPU, one line per shape."""
    data = table()
    lines = [HEADER + "GPUS = (", "    {"]
    lines += [f"        {key!r}: {value!r}," for key, value in data.items() if key not in ("runs", "shapes")]
    lines += ["        'runs': (", *(f"            {run!r}," for run in data["runs"]), "        ),"]
    lines.append("        'shapes': {")
    for dtype, shapes in data["shapes"].items():
        lines.append(f"            {dtype!r}: (")
        lines += [f"                {shape!r}," for shape in shapes]
        lines.append("            ),")
    lines += ["        },", "    },", ")", ""]
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    MODULE.write_text(module_text())
    print(f"wrote {MODULE}")


if __name__ == "__main__":
    main()

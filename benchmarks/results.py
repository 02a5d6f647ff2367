"""Result rows, the run's metadata, and where they are written: rows are appended to a CSV
(committed under benchmarks/results/), the metadata of each run to a JSON list beside it."""

import csv
import dataclasses
import datetime
import json
import pathlib
import platform
import shlex
import subprocess
import sys

import torch
import triton

from benchmarks.providers import TORCH_MM


@dataclasses.dataclass
class RunFields:
    """The columns every harness's rows begin with: which run, on what (run_fields)."""
    timestamp: str  # the run's start, UTC; also the key of its metadata in the JSON
    gpu: str
    num_sms: int | None
    torch: str
    triton: str
    cuda: str | None


def run_fields(env: dict) -> dict:
    """RunFields' values from the run's metadata (environment())."""
    return {f.name: env[f.name] for f in dataclasses.fields(RunFields)}


@dataclasses.dataclass
class Row(RunFields):
    mode: str  # gemm | contention | overhead
    dtype: str
    group: str
    shape: str
    m: int
    n: int
    k: int
    provider: str
    num_shards: int | None
    held_sms: int | None  # contention: SMs held by the hog
    gemms_per_window: int | None  # contention: back-to-back GEMMs per timed window
    p20_ms: float
    p50_ms: float
    p80_ms: float
    tflops: float | None = None  # 2*M*N*K / p50
    vs_torch_mm: float | None = None  # tflops / torch.mm's tflops, same shape and held SMs
    bytes: int | None = None  # element size * (MK + KN + MN)
    gbps: float | None = None  # bytes / p50
    rel_err: float | None = None  # relative Frobenius error vs float64, on sampled rows


def environment(device: torch.device, args: dict) -> dict:
    """What a row needs to be reproduced: hardware, versions, date, command, code version."""
    cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": props.name if cuda else f"cpu ({platform.processor() or platform.machine()}, interpreter)",
        "num_sms": props.multi_processor_count if cuda else None,
        "compute_capability": f"{props.major}.{props.minor}" if cuda else None,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1) if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or torch.version.hip,
        "python": platform.python_version(),
        "command": shlex.join([sys.executable, "-m", _main_module(), *sys.argv[1:]]),
        "git": _git_revision(),
        "args": args,
    }


def row(env: dict, **fields) -> Row:
    return Row(**run_fields(env), **fields)


def fill_ratios(rows: list[Row]) -> None:
    """Set vs_torch_mm on every row that has a torch.mm row to compare with."""
    baseline = {(r.mode, r.shape, r.held_sms): r.tflops for r in rows if r.provider == TORCH_MM}
    for r in rows:
        base = baseline.get((r.mode, r.shape, r.held_sms))
        if r.tflops is not None and base:
            r.vs_torch_mm = r.tflops / base


def check_columns(csv_path: pathlib.Path, row_type: type) -> list[str]:
    """row_type's columns; SystemExit if csv_path exists with other ones (a harness may call
    this before its run, so as not to find out after it)."""
    header = [f.name for f in dataclasses.fields(row_type)]
    if csv_path.exists():
        with csv_path.open() as f:
            existing = next(csv.reader(f), None)
        if existing != header:
            raise SystemExit(f"{csv_path} has columns {existing}, this harness writes {header}: "
                             "use a new --out file")
    return header


def append(csv_path: pathlib.Path, rows: list, env: dict) -> None:
    """rows: dataclass instances of one type (Row, or another harness's own). A run that
    appends as it goes (its rows kept if it is stopped) keeps one record of its environment,
    rewritten at each append: what the run adds to `env` as it goes (models.py's kernel
    names per case) lands with the rows it belongs to."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists()
    header = check_columns(csv_path, type(rows[0]) if rows else Row)
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        if new:
            writer.writeheader()
        writer.writerows(_rounded(dataclasses.asdict(r)) for r in rows)
    json_path = csv_path.with_suffix(".json")
    runs = json.loads(json_path.read_text()) if json_path.exists() else []
    if runs and runs[-1].get("timestamp") == env["timestamp"]:
        runs.pop()  # this run's earlier record
    json_path.write_text(json.dumps([*runs, env], indent=1, default=str) + "\n")


def _rounded(fields: dict) -> dict:
    """Five significant digits: well past the run-to-run noise, and a readable committed file."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in fields.items()}


def _main_module() -> str:
    """The harness that is running (python -m <this>)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else "benchmarks.bench"


def _git_revision() -> str | None:
    """HEAD, with '+dirty' when the work tree differs; None outside a git checkout."""
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")

"""Plots from the committed results CSVs, a separate step from measuring.

    python -m benchmarks.plot benchmarks/results/h200_bf16.csv [more.csv ...]

For each CSV, the latest run of each mode (or the run given by --timestamp) becomes
<csv stem>_gemm.png (TFLOP/s and ratio to torch.mm per shape) and
<csv stem>_contention.png (TFLOP/s against SMs held), next to the CSV or in --out-dir.
A CSV of benchmarks/grouped.py's rows becomes <csv stem>_speedup.png instead: ws's speedup
over torch._grouped_mm per case and GEMM, alone and with each count of SMs held. A CSV of
benchmarks/models.py's rows becomes <csv stem>_speedup.png: each variant's speedup over
default Inductor per model, step, CUDA graphs and SMs held, from the latest row of each
(several calls of models.py may fill one figure; --timestamp picks one run instead).
"""

import argparse
import csv
import pathlib



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", type=pathlib.Path)
    parser.add_argument("--timestamp", help="plot this run instead of the latest one")
    parser.add_argument("--out-dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    for path in args.csv:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        out_dir = args.out_dir or path.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        if rows and GROUPED_RATIO in rows[0]:  # benchmarks/grouped.py's rows: both modes in one figure
            figures = [("speedup", _grouped_figure, _run(rows, None, args.timestamp))]
        elif rows and MODEL_RATIO in rows[0]:  # benchmarks/models.py's rows
            figures = [("speedup", _models_figure, _latest_per_case(rows, args.timestamp))]
        else:
            figures = [(mode, draw, _run(rows, mode, args.timestamp))
                       for mode, draw in (("gemm", _gemm_figure), ("contention", _contention_figure))]
        for name, draw, run in figures:
            if run:
                out = out_dir / f"{path.stem}_{name}.png"
                draw(run).savefig(out, dpi=120, bbox_inches="tight")
                print(f"wrote {out}")


def Figure(**kwargs):
    # Figure objects, not pyplot: no global backend or figure state, and PNGs need no display.
    # Imported here: choosing the rows needs no matplotlib (`bench` extra), tests use that.
    from matplotlib.figure import Figure as figure
    return figure(**kwargs)


def _run(rows, mode, timestamp):
    """The rows of one run (the latest, or `timestamp`'s), of one mode (None: every mode)."""
    rows = [r for r in rows if mode is None or r["mode"] == mode]
    if not rows:
        return []
    chosen = timestamp or max(r["timestamp"] for r in rows)
    return [r for r in rows if r["timestamp"] == chosen]


def _title(run, what):
    r = run[0]
    return f"{what}: {r['gpu']}, {r['dtype']}\ntorch {r['torch']}, triton {r['triton']}, {r['timestamp']}"


def _providers(run):
    return list(dict.fromkeys(r["provider"] for r in run))


def _gemm_figure(run):
    shapes = list(dict.fromkeys(r["shape"] for r in run))
    providers = _providers(run)
    cell = {(r["shape"], r["provider"]): r for r in run}
    fig = Figure(figsize=(max(10, 0.5 * len(shapes)), 9), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(shapes))]
        top.bar(xs, [float(cell[s, provider]["tflops"]) for s in shapes], width, label=provider)
        if provider != "torch_mm":
            bottom.bar(xs, [float(cell[s, provider]["vs_torch_mm"]) for s in shapes], width, label=provider,
                       color=f"C{i}")
    # TFLOP/s spans three decades (decode shapes to 16384^3): log scale keeps all readable.
    top.set_yscale("log")
    top.set_ylabel("TFLOP/s (median)")
    top.legend(ncol=len(providers))
    top.set_title(_title(run, "GEMM"))
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("ratio to torch.mm")
    bottom.set_xticks(range(len(shapes)), shapes, rotation=60, ha="right")
    return fig


def _contention_figure(run):
    shapes = list(dict.fromkeys(r["shape"] for r in run))
    providers = _providers(run)
    fig = Figure(figsize=(6 * len(shapes), 4.5), layout="constrained")
    axes = fig.subplots(1, len(shapes), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for provider in providers:
            points = [(int(r["held_sms"]), float(r["tflops"])) for r in run
                      if r["shape"] == shape and r["provider"] == provider]
            ax.plot(*zip(*points), marker="o", label=provider)
        ax.set_xlabel("SMs held by another stream")
        ax.set_ylabel("TFLOP/s (median)")
        ax.set_title(shape)
        ax.legend()
    fig.suptitle(_title(run, "Under contention"))
    return fig


GROUPED_RATIO = "vs_torch_grouped_mm"  # the column that marks a CSV of grouped.py's rows
FLOOR, HELD_TARGET = 0.85, 1.2  # the grouped GEMM issue's floor and with-SMs-held geomean target


def _grouped_figure(run):
    """ws / torch_grouped_mm per case and GEMM kind: a bar per setting (alone, H SMs held)."""
    ws = [r for r in run if r["provider"] == "ws" and r[GROUPED_RATIO]]
    gemms = list(dict.fromkeys(f"{r['case']} {r['kind']}" for r in ws))
    settings = list(dict.fromkeys(_grouped_setting(r) for r in ws))
    ratio = {(f"{r['case']} {r['kind']}", _grouped_setting(r)): float(r[GROUPED_RATIO]) for r in ws}
    fig, ax = _ratio_bars(ratio, gemms, settings, inches_per_bar=0.25)
    ax.axhline(FLOOR, color="C3", linestyle="--", linewidth=0.8, label=f"floor {FLOOR:g}")
    ax.axhline(HELD_TARGET, color="C2", linestyle=":", linewidth=0.8, label=f"held geomean target {HELD_TARGET:g}")
    ax.set_ylabel("ws speedup over torch._grouped_mm (its time / ws's)")
    ax.legend(ncol=len(settings) + 2, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize="small")
    fig.suptitle(_title(run, "Grouped GEMM"))
    return fig


def _ratio_bars(ratio, groups, series, *, inches_per_bar):
    """A figure with a bar per (group, series) of ratio[group, series] (missing: no bar),
    the groups along x and a line at 1.0."""
    fig = Figure(figsize=(max(10, inches_per_bar * len(groups) * len(series)), 6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [ratio.get((g, name), float("nan")) for g in groups], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=60, ha="right")
    return fig, ax


def _grouped_setting(row):
    return "alone, cold L2" if row["mode"] == "gemm" else f"{row['held_sms']} SMs held"


MODEL_RATIO = "vs_default"  # the column that marks a CSV of models.py's rows
MODEL_FLOOR = 0.97  # the model-speed issue's "never below" line


def _model_case(row):
    graphs = "graphs" if row["cuda_graphs"] == "True" else "eager launch"
    return f"{row['model']} {row['step']}, {graphs}, {row['held_sms']} held"


def _latest_per_case(rows, timestamp):
    """The newest row of each (case, variant), or the rows of run `timestamp`."""
    if timestamp:
        return [r for r in rows if r["timestamp"] == timestamp]
    latest = {}
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        latest[_model_case(r), r["variant"]] = r
    return list(latest.values())


def _models_figure(run):
    """Each variant's time relative to default Inductor's (its p50 / theirs), per case."""
    others = [r for r in run if r["variant"] != "default" and r[MODEL_RATIO]]
    cases = list(dict.fromkeys(_model_case(r) for r in others))
    variants = list(dict.fromkeys(r["variant"] for r in others))
    ratio = {(_model_case(r), r["variant"]): float(r[MODEL_RATIO]) for r in others}
    fig, ax = _ratio_bars(ratio, cases, variants, inches_per_bar=0.22)
    ax.axhline(MODEL_FLOOR, color="C3", linestyle="--", linewidth=0.8, label=f"floor {MODEL_FLOOR:g}")
    ax.set_ylim(bottom=min(0.6, *ratio.values()) if ratio else 0.6)
    ax.set_ylabel("speedup over default Inductor (its ms / the variant's)")
    ax.legend(ncol=len(variants) + 1, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize="small")
    stamps = sorted({r["timestamp"] for r in run})
    r = run[0]
    fig.suptitle(f"Models: {r['gpu']}, torch {r['torch']}, triton {r['triton']}, {stamps[0]} to {stamps[-1]}")
    return fig


if __name__ == "__main__":
    main()

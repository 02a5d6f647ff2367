"""The compact tables printed at the end of a run."""

import math

from benchmarks.providers import OVERHEAD_BASELINES, STATIC, TORCH_MM, WORK_STEALING
from benchmarks.results import Row


def _providers(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.provider for r in rows))


def _by(rows: list[Row], *keys: str) -> dict:
    return {tuple(getattr(r, k) for k in keys): r for r in rows}


def gemm_table(rows: list[Row]) -> str:
    providers = _providers(rows)
    others = [p for p in providers if p != TORCH_MM]
    cell = _by(rows, "shape", "provider")
    shapes = list(dict.fromkeys((r.shape, r.m, r.n, r.k) for r in rows))
    width = {p: max(10, len(p) + 5) for p in providers}  # room for the "/mm" of the ratio columns
    lines = [f"{'shape':<20}{'M':>6}{'N':>7}{'K':>7}" + "".join(f"{p:>{width[p]}}" for p in providers)
             + "".join(f"{p + '/mm':>{width[p]}}" for p in others)]
    for name, m, n, k in shapes:
        line = f"{name:<20}{m:>6}{n:>7}{k:>7}"
        line += "".join(f"{cell[name, p].tflops:>{width[p]}.4g}" for p in providers)
        line += "".join(f"{cell[name, p].vs_torch_mm:>{width[p]}.3g}" for p in others)
        lines.append(line)
    lines += ["TFLOP/s at the median time; p/mm = p's TFLOP/s over torch.mm's.", ""]
    for p in others:
        lines.append(_ratio_summary(f"{p} / torch_mm", [(s[0], cell[s[0], p].vs_torch_mm) for s in shapes]))
    for p in (p for p in others if p.startswith(WORK_STEALING)):
        lines.append(_ratio_summary(f"{p} / static", [
            (s[0], cell[s[0], p].tflops / cell[s[0], STATIC].tflops) for s in shapes]))
    return "\n".join(lines)


def _ratio_summary(label: str, ratios: list[tuple[str, float]]) -> str:
    geomean = math.exp(sum(math.log(r) for _, r in ratios) / len(ratios))
    worst_shape, worst = min(ratios, key=lambda sr: sr[1])
    return f"{label:<22} geomean {geomean:.3g}   min {worst:.3g} ({worst_shape})   over {len(ratios)} shapes"


def contention_table(rows: list[Row]) -> str:
    providers = _providers(rows)
    ws = [p for p in providers if p.startswith(WORK_STEALING)]
    cell = _by(rows, "shape", "held_sms", "provider")
    lines = []
    for shape in dict.fromkeys(r.shape for r in rows):
        shape_rows = [r for r in rows if r.shape == shape]
        gemms = ", ".join(f"{p} {cell[shape, shape_rows[0].held_sms, p].gemms_per_window}" for p in providers)
        lines.append(f"{shape}: TFLOP/s while H SMs are held, median of the trials "
                     f"(back-to-back GEMMs per window: {gemms})")
        lines.append(f"{'H':>4}" + "".join(f"{p:>10}" for p in providers)
                     + "".join(f"{p + '/mm':>11}{p + '/static':>13}" for p in ws))
        for held in dict.fromkeys(r.held_sms for r in shape_rows):
            c = {p: cell[shape, held, p] for p in providers}
            lines.append(f"{held:>4}" + "".join(f"{c[p].tflops:>10.1f}" for p in providers)
                         + "".join(f"{c[p].vs_torch_mm:>11.3f}{c[p].tflops / c[STATIC].tflops:>13.3f}"
                                   for p in ws))
        lines.append("")
    return "\n".join(lines)


def overhead_table(rows: list[Row]) -> str:
    cell = {r.provider: r for r in rows}
    lines = [f"host wall time per eager call, {rows[0].shape} {rows[0].dtype} (us; p20 / p50 / p80 over trials)"]
    lines += [f"  {p:<12}{r.p20_ms * 1e3:>8.1f}{r.p50_ms * 1e3:>8.1f}{r.p80_ms * 1e3:>8.1f}" for p, r in cell.items()]
    for p in (p for p in cell if p != TORCH_MM):
        base = next((b for name, b in OVERHEAD_BASELINES.items() if p.startswith(name) and b in cell), TORCH_MM)
        lines.append(f"  {p} - {base} = {(cell[p].p50_ms - cell[base].p50_ms) * 1e3:+.1f} us per call")
    return "\n".join(lines)

"""Grouped GEMMs of mixture-of-experts layers: torch.ops.tritonblas.ws_grouped_mm against
torch._grouped_mm and a loop of torch.mm per expert, side by side in one process.

    python -m benchmarks.grouped [--held 0,16,33] [--cases mixtral_t4096_zipf,...]
        [--kinds forward,wgrad] [--out benchmarks/results/h200_grouped.csv] [--smoke]
    python -m benchmarks.grouped --moe-layer [--held 0,16,33] [--out benchmarks/results/h200_grouped_moe.csv]

A case is an MoE shape, the tokens of one step and how the router spreads them, named
<shape>_t<tokens>_<distribution> (--cases takes any such name):
  shapes         mixtral     hidden 4096, expert FFN 14336, 8 experts, top-2 (Mixtral 8x7B)
                 qwen        hidden 4096, FFN 1408, 64 experts, top-4 (Qwen-MoE-like)
                 qwen_small  hidden 2048, FFN 1408, 64 experts, top-4 (Qwen1.5-MoE-A2.7B-like)
                 dsv3        hidden 7168, FFN 2048, 128 experts, top-8 (DeepSeek-V3-like)
                 dsv3_e64    hidden 7168, FFN 2048, 64 experts, top-8
                 tiny        hidden 32, FFN 48, 6 experts, top-2 (--smoke)
  distributions  uniform     every expert equally likely
                 zipf        the i-th most popular expert has weight i^-1.2
                 skewed      measured-looking: lognormal spread, a few hot experts (6x), a few
                             nearly idle ones (0.02x) and one that no token picks (an empty group)
Each token picks top_k distinct experts with these weights (torch.multinomial, seeded from the
case's name: the same group sizes every run; the experts' order is shuffled, so the hot ones
sit anywhere). The rows (tokens x top_k) are sorted by expert; offs holds the groups' ends,
the last one the row count (rows past it would be left unwritten by torch._grouped_mm). Group
sizes are not padded to any multiple. A row records its case's smallest and largest group,
its empty groups and the largest over the mean; the run's JSON metadata has every group size.

Two GEMMs per case, bf16:
  forward  (rows, hidden) x (G, hidden, ffn) -> (rows, ffn): 2-D x 3-D, split along M
  wgrad    (hidden, rows) x (rows, ffn) -> (G, hidden, ffn): 2-D x 2-D split along K, the
           forward's weight gradient: x^T (a transposed view, as autograd passes it) times dOut
Providers: ws (torch.ops.tritonblas.ws_grouped_mm), torch_grouped_mm (torch._grouped_mm:
CUTLASS on the H200), cublas_loop (torch.mm per group into its slice of one output; the
groups' bounds are read from offs on the host once, before any timing); on request
ws_pointer_loads (ws with pointer loads instead of tensor descriptors).

Each provider's output first passes the float64 gate (measure.py): output memory poisoned
with NaN, the whole output finite, evenly spaced rows of every group (with its last) against
a float64 reference computed group by group, relative Frobenius error under
measure.TOLERANCE; and an empty group's weight gradient must be exactly zero. Then:
  gemm mode        one call with a cold L2, from CUDA-graph replay (measure.time_ms)
  contention mode  for each --held H, back-to-back calls while another stream holds H whole
                   SMs (contention.py; H = 0: no hog). Each call is the replay of a CUDA
                   graph of it, so no provider's host launches (the loop's G torch.mm calls)
                   reach the window.
The table: ms per provider, TFLOP/s (2 x rows x hidden x ffn over the median time), ws's
speedup over torch_grouped_mm and over the loop; then, per mode and held count, the geomean
and the minimum of ws / torch_grouped_mm against the issue's targets.

--moe-layer instead times a compiled MoE layer's training step (router, top-k, tokens sorted
by expert, gate / up / down grouped GEMMs with SwiGLU, weighted combine; forward + backward,
bf16), built on torch._grouped_mm so Inductor sees aten._grouped_mm: default Inductor against
routing on, with benchmarks/models.py's variants and timing (its rows are models.ModelRow).
--smoke: tiny fp32 cases on the CPU (ws through Triton's interpreter; torch._grouped_mm runs
on the CPU too), the gemm mode only: the plumbing.
"""

import argparse
import dataclasses
import math
import pathlib
import re
import types
import zlib
from typing import Callable

import torch
import torch.nn.functional as F

import tritonblas_ops
from benchmarks import contention, measure, models, report, results
from benchmarks.providers import without_warp_specialization
from tritonblas_ops.grouped import grouped_mm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is a nicety
    def tqdm(iterable, **_):
        return iterable

WS, TORCH_GROUPED_MM, CUBLAS_LOOP = "ws", "torch_grouped_mm", "cublas_loop"
PROVIDERS = (WS, TORCH_GROUPED_MM, CUBLAS_LOOP)  # the default list
# ws with pointer loads (no tensor descriptors): a weight gradient's programs otherwise build
# two descriptors per tile (its group's K range), on each tile's critical path.
WS_POINTER_LOADS = "ws_pointer_loads"
# ws with the warp-specialized kernel's setting off: the weight gradients on the grouped
# Triton kernel, which sm_90 launches otherwise leave for the warp-specialized one.
WS_TRITON_KERNEL = "ws_triton_kernel"
FORWARD, WGRAD = "forward", "wgrad"
KINDS = (FORWARD, WGRAD)
DISTRIBUTIONS = ("uniform", "zipf", "skewed")
HELD = [0, 16, 33]

# The targets for ws / torch_grouped_mm: the geomean alone and with SMs held, and
# the floor no case may fall below.
TARGET_ALONE, TARGET_HELD, TARGET_FLOOR = 1.0, 1.2, 0.85

ZIPF_EXPONENT = 1.2
HOT_FACTOR, COLD_FACTOR, SPREAD_SIGMA = 6.0, 0.02, 0.5


# ---------------------------------------------------------------------------------------
# Cases and their group sizes
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEShape:
    hidden: int
    ffn: int
    experts: int
    top_k: int


SHAPES = {
    "mixtral": MoEShape(hidden=4096, ffn=14336, experts=8, top_k=2),
    "qwen": MoEShape(hidden=4096, ffn=1408, experts=64, top_k=4),
    "qwen_small": MoEShape(hidden=2048, ffn=1408, experts=64, top_k=4),
    "dsv3": MoEShape(hidden=7168, ffn=2048, experts=128, top_k=8),
    "dsv3_e64": MoEShape(hidden=7168, ffn=2048, experts=64, top_k=8),
    "tiny": MoEShape(hidden=32, ffn=48, experts=6, top_k=2),  # --smoke
}
CASE_PATTERN = re.compile(rf"(\w+?)_t(\d+)_({'|'.join(DISTRIBUTIONS)})")


@dataclasses.dataclass(frozen=True)
class Case:
    shape_name: str
    tokens: int
    distribution: str

    @property
    def name(self) -> str:
        return f"{self.shape_name}_t{self.tokens}_{self.distribution}"

    @property
    def shape(self) -> MoEShape:
        return SHAPES[self.shape_name]


def parse_cases(text: str) -> list[Case]:
    cases = []
    for name in filter(None, text.split(",")):
        match = CASE_PATTERN.fullmatch(name)
        if match is None or match[1] not in SHAPES:
            raise argparse.ArgumentTypeError(
                f"case {name!r} is not <shape>_t<tokens>_<distribution> with shape one of "
                f"{sorted(SHAPES)} and distribution one of {list(DISTRIBUTIONS)}")
        cases.append(Case(match[1], int(match[2]), match[3]))
    return cases


# About 14 cases x 2 kinds x (alone + 3 held counts): ~4 minutes on the H200. Every shape
# and distribution, 4096-65536 tokens; the largest GEMMs ~4 TFLOP (~6 ms).
CASES = parse_cases(
    "mixtral_t4096_zipf,mixtral_t4096_skewed,mixtral_t8192_uniform,mixtral_t16384_zipf,"
    "qwen_t4096_zipf,qwen_t16384_skewed,qwen_t65536_uniform,"
    "qwen_small_t4096_uniform,qwen_small_t8192_skewed,qwen_small_t32768_zipf,"
    "dsv3_t4096_zipf,dsv3_t4096_skewed,dsv3_t8192_uniform,dsv3_t16384_skewed")
SMOKE_CASES = parse_cases("tiny_t24_zipf,tiny_t40_skewed")


def _generator(name: str) -> torch.Generator:
    """Seeded from the name alone: a case draws the same numbers whatever else runs."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def expert_weights(distribution: str, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Each expert's routing weight (unnormalized), the experts in a shuffled order."""
    if distribution == "uniform":
        weights = torch.ones(experts, dtype=torch.float64)
    elif distribution == "zipf":
        weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    else:
        weights = torch.empty(experts, dtype=torch.float64).log_normal_(0.0, SPREAD_SIGMA, generator=generator)
        hot, cold = max(1, experts // 16), max(1, experts // 8)
        weights[:hot] *= HOT_FACTOR
        weights[hot:hot + cold] *= COLD_FACTOR
        weights[-1] = 0.0  # never picked: an empty group
    return weights[torch.randperm(experts, generator=generator)]


def group_sizes(case: Case) -> list[int]:
    """Rows per expert: each token picks top_k distinct experts, as a router's top-k does."""
    generator = _generator(case.name)
    shape = case.shape
    weights = expert_weights(case.distribution, shape.experts, generator)
    picks = torch.multinomial(weights.expand(case.tokens, -1), shape.top_k, replacement=False,
                              generator=generator)
    return torch.bincount(picks.flatten(), minlength=shape.experts).tolist()


def skew(sizes: list[int]) -> dict:
    """The row's summary of the group sizes."""
    return dict(group_min=min(sizes), group_max=max(sizes), empty_groups=sizes.count(0),
                max_over_mean=max(sizes) / (sum(sizes) / len(sizes)))


# ---------------------------------------------------------------------------------------
# Operands, the gate's reference and the providers
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    kind: str
    a: torch.Tensor
    b: torch.Tensor
    offs: torch.Tensor  # int32 (G,) on the device: each group's end
    bounds: list[tuple[int, int]]  # each group's [begin, end), on the host
    out_shape: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.out_shape[-1]

    @property
    def hidden(self) -> int:
        return self.a.shape[0] if self.kind == WGRAD else self.a.shape[1]


def problem(case: Case, kind: str, sizes: list[int], dtype: torch.dtype, device: torch.device) -> Problem:
    shape = case.shape
    ends = torch.tensor(sizes).cumsum(0).tolist()
    bounds = list(zip([0, *ends[:-1]], ends))
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    rows = ends[-1]
    torch.manual_seed(zlib.crc32(f"{case.name} {kind}".encode()))
    x = torch.randn(rows, shape.hidden, dtype=dtype, device=device)
    if kind == FORWARD:
        w = torch.randn(shape.experts, shape.hidden, shape.ffn, dtype=dtype, device=device)
        return Problem(kind, x, w, offs, bounds, (rows, shape.ffn))
    grad_out = torch.randn(rows, shape.ffn, dtype=dtype, device=device)
    return Problem(kind, x.mT, grad_out, offs, bounds, (shape.experts, shape.hidden, shape.ffn))


def flops(p: Problem) -> float:
    """2 x rows x hidden x ffn, forward and weight gradient alike."""
    return 2.0 * p.bounds[-1][1] * p.hidden * p.n


def traffic_bytes(p: Problem) -> int:
    """The compulsory traffic: both operands and the output, once."""
    return p.a.element_size() * (p.a.numel() + p.b.numel() + math.prod(p.out_shape))


def check_rows(p: Problem) -> torch.Tensor:
    """Rows of the output, seen as a matrix ((G x hidden, ffn) for wgrad), that the gate
    compares: in every group evenly spaced ones with its last (the ragged edge tile),
    about measure.REFERENCE_ROWS in all."""
    if p.kind == FORWARD:
        spans = [(begin, end) for begin, end in p.bounds if end > begin]
    else:
        spans = [(g * p.hidden, (g + 1) * p.hidden) for g in range(len(p.bounds))]
    per_span = max(2, measure.REFERENCE_ROWS // len(spans))
    picks = [torch.linspace(begin, end - 1, min(per_span, end - begin), dtype=torch.float64).round().long()
             for begin, end in spans]
    return torch.unique(torch.cat(picks))


def reference(p: Problem, rows: torch.Tensor) -> torch.Tensor:
    """float64 output rows `rows`, group by group."""
    ref = torch.empty(len(rows), p.n, dtype=torch.float64, device=p.a.device)
    for g, (begin, end) in enumerate(p.bounds):
        if p.kind == FORWARD:
            mine = (rows >= begin) & (rows < end)
            if mine.any():
                ref[mine.to(ref.device)] = measure.matmul_ref(p.a, p.b[g], rows[mine])
        else:
            mine = rows // p.hidden == g  # an empty group's reference is zeros (K = 0)
            ref[mine.to(ref.device)] = measure.matmul_ref(p.a[:, begin:end], p.b[begin:end], rows[mine] % p.hidden)
    return ref


def provider_calls(p: Problem, names: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    calls = {
        WS: lambda: torch.ops.tritonblas.ws_grouped_mm(p.a, p.b, p.offs),
        WS_POINTER_LOADS: lambda: grouped_mm(p.a, p.b, p.offs, use_tma=False),
        WS_TRITON_KERNEL: lambda: without_warp_specialization(lambda: grouped_mm(p.a, p.b, p.offs)),
        TORCH_GROUPED_MM: lambda: torch._grouped_mm(p.a, p.b, offs=p.offs),
        CUBLAS_LOOP: mm_loop(p),
    }
    return {name: calls[name] for name in names}


def mm_loop(p: Problem) -> Callable[[], torch.Tensor]:
    """torch.mm per group into its slice of one output: what runs without a grouped GEMM.
    The slices are cut here, once, from the bounds read off offs on the host."""
    if p.kind == FORWARD:
        pieces = [(p.a[begin:end], p.b[g], begin, end) for g, (begin, end) in enumerate(p.bounds)]

        def forward():
            out = p.a.new_empty(p.out_shape)
            for a, b, begin, end in pieces:
                torch.mm(a, b, out=out[begin:end])
            return out

        return forward
    pieces = [(p.a[:, begin:end], p.b[begin:end]) for begin, end in p.bounds]

    def wgrad():
        out = p.a.new_empty(p.out_shape)
        for g, (a, b) in enumerate(pieces):
            torch.mm(a, b, out=out[g])  # K = 0 (an empty group): torch.mm writes zeros
        return out

    return wgrad


def verified_error(call, p: Problem, rows: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """The relative error of the call's output, once it passed the gate. The first call
    compiles (and allocates); the checked one is the next, into NaN-poisoned memory."""
    call()
    measure.poison_allocator(math.prod(p.out_shape), p.a.dtype, p.a.device)
    out = call()
    if tuple(out.shape) != p.out_shape:
        raise AssertionError(f"{what}: output shape {tuple(out.shape)}, expected {p.out_shape}")
    error = measure.check(out.reshape(-1, p.n), ref, rows, measure.TOLERANCE[p.a.dtype], what)
    if p.kind == WGRAD:
        for g, (begin, end) in enumerate(p.bounds):
            if begin == end and out[g].count_nonzero().item():
                raise AssertionError(f"{what}: group {g} has no rows, yet its weight gradient is not zero")
    return error


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class GroupedRow(results.RunFields):
    mode: str  # gemm (one call, cold L2) | contention (back to back, held_sms SMs held)
    case: str
    kind: str  # forward | wgrad
    dtype: str
    experts: int
    top_k: int
    tokens: int  # of the step; the GEMM has tokens x top_k rows
    hidden: int
    ffn: int
    m: int  # the GEMM as (M, K) x (K, N): forward M = rows, split by expert; wgrad K = rows
    n: int
    k: int
    distribution: str
    group_min: int
    group_max: int
    empty_groups: int
    max_over_mean: float  # the largest group over the mean group
    provider: str
    held_sms: int | None  # contention: SMs held by the hog
    gemms_per_window: int | None  # contention: back-to-back calls per timed window
    p20_ms: float
    p50_ms: float
    p80_ms: float
    tflops: float | None = None  # 2 x rows x hidden x ffn / p50
    vs_torch_grouped_mm: float | None = None  # torch_grouped_mm's p50 / this p50: above 1, faster
    bytes: int | None = None  # element size x (A + B + C)
    gbps: float | None = None  # bytes / p50
    rel_err: float | None = None  # relative Frobenius error vs float64, on sampled rows


def measure_case(case: Case, kind: str, sizes: list[int], dtype, device, streams, args, env) -> list[GroupedRow]:
    """Rows of every provider: alone, then under each --held count (on the GPU)."""
    p = problem(case, kind, sizes, dtype, device)
    rows = check_rows(p)
    ref = reference(p, rows)
    calls = provider_calls(p, args.providers)
    errors = {name: verified_error(call, p, rows, ref, f"{name} on {case.name} {kind} ({dtype})")
              for name, call in calls.items()}
    alone = measure.time_ms(calls, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)

    def row(name, mode, times, held=None, gemms=None):
        return _row(env, case, p, sizes, name, mode, times, errors[name], held, gemms)

    out = [row(name, "gemm", alone[name]) for name in calls]
    if streams is not None:
        for held, times, gemms in held_times(calls, alone, args.held, env["num_sms"], streams):
            out += [row(name, "contention", times[name], held, gemms[name]) for name in calls]
    return out


def held_times(calls: dict, alone: dict, held_list: list[int], num_sms: int, streams):
    """(held, {name: (p20, p50, p80) ms per call}, {name: calls per window}) per held count.
    Each call is replayed from a CUDA graph of it: the GPU's work of an eager call, without
    the host's launches (for the loop, one torch.mm per group). Providers take turns inside
    each trial, so slow drifts (clocks, heat) hit all alike."""
    replays = {name: _graph_replay(call) for name, call in calls.items()}
    unheld_ms = {name: alone[name][1] for name in calls}
    gemms = {name: contention.gemms_per_window(unheld_ms[name]) for name in calls}
    for held in held_list:
        samples = {name: [] for name in calls}
        for _ in range(contention.TRIALS):
            for name, replay in replays.items():
                samples[name].append(contention.held_ms_per_gemm(
                    replay, gemms[name], held, unheld_ms[name], num_sms, streams))
        yield held, {name: measure.quantiles(s) for name, s in samples.items()}, gemms


def _graph_replay(fn) -> Callable[[], None]:
    """fn (already called: compiled, its libraries set up) captured once; replay() runs it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _row(env, case, p, sizes, provider, mode, times, error, held, gemms) -> GroupedRow:
    p20, p50, p80 = times
    shape = case.shape
    rows = p.bounds[-1][1]
    m, k = (rows, shape.hidden) if p.kind == FORWARD else (shape.hidden, rows)
    nbytes = traffic_bytes(p)
    return GroupedRow(
        **results.run_fields(env), mode=mode, case=case.name, kind=p.kind,
        dtype=str(p.a.dtype).removeprefix("torch."), experts=shape.experts, top_k=shape.top_k,
        tokens=case.tokens, hidden=shape.hidden, ffn=shape.ffn, m=m, n=shape.ffn, k=k,
        distribution=case.distribution, **skew(sizes), provider=provider, held_sms=held,
        gemms_per_window=gemms, p20_ms=p20, p50_ms=p50, p80_ms=p80,
        tflops=flops(p) / (p50 * 1e-3) / 1e12, bytes=nbytes, gbps=nbytes / (p50 * 1e-3) / 1e9,
        rel_err=error)


def fill_ratios(rows: list[GroupedRow]) -> None:
    """vs_torch_grouped_mm on every row with a torch_grouped_mm row beside it."""
    base = {_setting(r): r.p50_ms for r in rows if r.provider == TORCH_GROUPED_MM}
    for r in rows:
        if _setting(r) in base:
            r.vs_torch_grouped_mm = base[_setting(r)] / r.p50_ms


def _setting(r: GroupedRow) -> tuple:
    return r.mode, r.case, r.kind, r.held_sms


def run_cases(args, env, device) -> list[GroupedRow]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if device.type == "cuda" and args.held else None
    rows = []
    for case in tqdm(args.cases, unit="case"):
        sizes = group_sizes(case)
        env.setdefault("group_sizes", {})[case.name] = sizes  # the run's metadata keeps them all
        for kind in args.kinds:
            rows += measure_case(case, kind, sizes, dtype, device, streams, args, env)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next case's operands may be larger
    fill_ratios(rows)
    return rows


# ---------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------

MODE_TITLES = {
    "gemm": "Alone: one call, cold L2 (on the GPU from CUDA-graph replay)",
    "contention": "Back-to-back calls while another stream holds H SMs (median of the trials)",
}
SHORT = {WS: "ws", TORCH_GROUPED_MM: "tgmm", CUBLAS_LOOP: "loop", WS_POINTER_LOADS: "wsptr",
         WS_TRITON_KERNEL: "wstri"}  # the table's column labels
COLUMN = 10


def table(rows: list[GroupedRow]) -> str:
    providers = list(dict.fromkeys(r.provider for r in rows))
    cell = {(*_setting(r), r.provider): r for r in rows}
    ratios = [p for p in (TORCH_GROUPED_MM, CUBLAS_LOOP) if WS in providers and p in providers]
    lines = []
    for mode in dict.fromkeys(r.mode for r in rows):
        lines.append(MODE_TITLES[mode])
        labels = ([f"{SHORT[p]} ms" for p in providers] + [f"{SHORT[p]} TF/s" for p in providers]
                  + [f"ws/{SHORT[p]}" for p in ratios])
        lines.append(f"{'case':<25}{'kind':<8}{'H':>4}{'groups min/max/empty':>22}"
                     + "".join(f"{label:>{COLUMN}}" for label in labels))
        for setting in dict.fromkeys(_setting(r) for r in rows if r.mode == mode):
            c = {p: cell[(*setting, p)] for p in providers}
            first = c[providers[0]]
            groups = f"{first.group_min}/{first.group_max}/{first.empty_groups}"
            held = "-" if first.held_sms is None else first.held_sms
            lines.append(f"{first.case:<25}{first.kind:<8}{held:>4}{groups:>22}"
                         + "".join(f"{c[p].p50_ms:>{COLUMN}.3f}" for p in providers)
                         + "".join(f"{c[p].tflops:>{COLUMN}.4g}" for p in providers)
                         + "".join(f"{c[p].p50_ms / c[WS].p50_ms:>{COLUMN}.3f}" for p in ratios))
        lines.append("")
    lines.append("ms: the median; TF/s: TFLOP/s at the median; ws/p: p's time over ws's (above 1: ws "
                 "faster); " + ", ".join(f"{SHORT[p]} = {p}" for p in providers if SHORT[p] != p))
    if WS in providers and TORCH_GROUPED_MM in providers:
        lines += summary(rows)
    return "\n".join(lines)


def summary(rows: list[GroupedRow]) -> list[str]:
    """ws / torch_grouped_mm per mode and held count: geomean and minimum, against the targets."""
    lines = [f"ws / torch_grouped_mm (above 1: ws faster). Targets: geomean >= {TARGET_ALONE:g} alone, "
             f">= {TARGET_HELD:g} with SMs held, no case below {TARGET_FLOOR:g}."]
    ws_rows = [r for r in rows if r.provider == WS and r.vs_torch_grouped_mm is not None]
    for mode, held in dict.fromkeys((r.mode, r.held_sms) for r in ws_rows):
        ratios = [(f"{r.case}/{r.kind}", r.vs_torch_grouped_mm) for r in ws_rows
                  if (r.mode, r.held_sms) == (mode, held)]
        label = "alone, cold L2" if mode == "gemm" else f"{held} SMs held"
        target = TARGET_HELD if held else TARGET_ALONE
        geomean = math.exp(sum(math.log(x) for _, x in ratios) / len(ratios))
        worst = min(x for _, x in ratios)
        met = geomean >= target and worst >= TARGET_FLOOR
        lines.append(f"  {report._ratio_summary(label, ratios)}   "
                     f"{'meets' if met else 'misses'} (geomean >= {target:g}, min >= {TARGET_FLOOR:g})")
    return lines


# ---------------------------------------------------------------------------------------
# --moe-layer: a compiled MoE layer's training step
# ---------------------------------------------------------------------------------------


class MoELayer(torch.nn.Module):
    """Router, top-k, tokens sorted by expert, SwiGLU experts as grouped GEMMs, weighted
    combine. Built on torch._grouped_mm, so Inductor sees aten._grouped_mm (forward and
    backward) and routing can take it."""

    def __init__(self, shape: MoEShape):
        super().__init__()
        self.top_k = shape.top_k
        self.router = torch.nn.Linear(shape.hidden, shape.experts, bias=False)
        self.gate = torch.nn.Parameter(torch.randn(shape.experts, shape.hidden, shape.ffn) * shape.hidden ** -0.5)
        self.up = torch.nn.Parameter(torch.randn(shape.experts, shape.hidden, shape.ffn) * shape.hidden ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(shape.experts, shape.ffn, shape.hidden) * shape.ffn ** -0.5)

    def forward(self, x):
        weights, experts = self.router(x).float().softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token = order // self.top_k  # the token of each row, rows sorted by expert
        # Counted by scatter_add (a static shape), not bincount (a data-dependent one).
        counts = torch.zeros(self.gate.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        rows = x[token]
        h = F.silu(torch._grouped_mm(rows, self.gate, offs=offs)) * torch._grouped_mm(rows, self.up, offs=offs)
        y = torch._grouped_mm(h, self.down, offs=offs) * weights.flatten()[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, y)


# name: (shape, tokens per step)
MOE_LAYERS = {"mixtral": ("mixtral", 8192), "dsv3_e64": ("dsv3_e64", 4096)}
SMOKE_MOE_LAYERS = {"tiny": ("tiny", 16)}


def run_moe_layers(args, env, device) -> list[models.ModelRow]:
    # bf16 on the CPU too: aten._grouped_mm's meta function, which torch.compile runs,
    # takes bf16 alone.
    dtype = torch.bfloat16
    layers = SMOKE_MOE_LAYERS if args.smoke else {name: MOE_LAYERS[name] for name in args.layers}
    timing = types.SimpleNamespace(variants=args.variants, held=args.held or [0], trials=args.trials,
                                   steps_per_trial=args.steps_per_trial)
    models.keep_every_variant_compiled()
    rows = []
    for name, (shape_name, tokens) in tqdm(layers.items(), unit="layer"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = MoELayer(SHAPES[shape_name]).to(device=device, dtype=dtype)
        x = torch.randn(tokens, SHAPES[shape_name].hidden, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        rows += models.measure_model(f"moe_{name}_t{tokens}", layer, x, grad, "train", False, timing, env)
    return rows


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    env = results.environment(device, {**vars(args), "cases": [case.name for case in args.cases]})
    sms = f" ({env['num_sms']} SMs)" if env["num_sms"] else ""
    print(f"{env['gpu']}{sms}, torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}, {env['timestamp']}")
    if args.held and device.type == "cuda" and not 0 <= min(args.held) <= max(args.held) < env["num_sms"]:
        raise SystemExit(f"--held: SM counts must lie in [0, {env['num_sms']}), got {args.held}")
    if args.moe_layer:
        if args.out:
            results.check_columns(args.out, models.ModelRow)  # before the run, not after it
        rows = run_moe_layers(args, env, device)
        print(models.table(rows))
    else:
        if args.out:
            results.check_columns(args.out, GroupedRow)
        rows = run_cases(args, env, device)
        print(table(rows))
    if args.out:
        results.append(args.out, rows, env)
        print(f"appended {len(rows)} rows to {args.out}")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grouped", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=parse_cases, metavar="SHAPE_tTOKENS_DIST,...",
                        help="e.g. mixtral_t65536_zipf,dsv3_t16384_uniform (default: the list in CASES)")
    parser.add_argument("--kinds", type=models._csv_list(str, KINDS), default=list(KINDS))
    parser.add_argument("--providers", type=models._csv_list(str, (*PROVIDERS, WS_POINTER_LOADS, WS_TRITON_KERNEL)),
                        default=list(PROVIDERS),
                        help=f"also {WS_POINTER_LOADS}, {WS_TRITON_KERNEL} (not in the default list)")
    parser.add_argument("--held", type=models._csv_list(int), default=HELD, metavar="H,H,...",
                        help="SMs another stream holds, one contention run each (0: none); '' for "
                             "the gemm mode alone")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="GPU warmup per provider and GEMM")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="GPU time timing each provider and GEMM")
    parser.add_argument("--moe-layer", action="store_true",
                        help="time a compiled MoE layer's training step instead (rows: models.ModelRow)")
    parser.add_argument("--layers", type=models._csv_list(str, MOE_LAYERS), default=list(MOE_LAYERS),
                        help="--moe-layer: which layers")
    parser.add_argument("--variants", type=models._csv_list(str, models.VARIANTS), default=["default", "routed"],
                        help="--moe-layer: benchmarks/models.py's variants")
    parser.add_argument("--trials", type=int, default=7, help="--moe-layer")
    parser.add_argument("--steps-per-trial", type=int, default=10, help="--moe-layer")
    parser.add_argument("--out", type=pathlib.Path, help="CSV to append rows to (metadata to the .json beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny fp32 cases")
    args = parser.parse_args(argv)
    if args.cases is None:
        args.cases = SMOKE_CASES if args.smoke else CASES
    if args.smoke:
        args.held = []  # contention needs a GPU; the CPU times the gemm mode alone
        args.rep_ms = min(args.rep_ms, 1.0)
        args.trials, args.steps_per_trial = min(args.trials, 2), min(args.steps_per_trial, 1)
        if args.moe_layer:
            tritonblas_ops.route_cpu(True)  # routed CPU GEMMs run the kernel in the interpreter
    return args


if __name__ == "__main__":
    main()

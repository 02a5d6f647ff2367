"""Compiled models, default Inductor against routing: the model-level benchmark.

    python -m benchmarks.models [--models gpt2_mlp,llama_small,llama_8b,decode_8b_t1,decode_8b_t16]
        [--variants default,default_again,max_autotune,routed,routed_inline,routed_fused,routed_auto]
        [--steps forward,train]
        [--graphs off,on] [--held 0,16,33] [--trials 7] [--out benchmarks/results/h200_models.csv]

Models (bf16, one block each, weights from one seed):
  gpt2_mlp      GPT-2's MLP: Linear(768, 3072) + GELU (tanh) + Linear(3072, 768), biases,
                8 x 1024 tokens
  llama_small   a Llama-style block (RMSNorm, causal attention, SwiGLU): hidden 1024,
                16 heads, FFN 2816, 4 x 1024 tokens
  llama_8b      the same block at Llama-3-8B's size: hidden 4096, 32 heads (8 key/value
                heads), FFN 14336, 4 x 2048 tokens
  decode_8b_tN  one decode step of llama_8b for N sequences (one new token each) against a
                KV cache of 2048 tokens: forward only
Variants: `default` (Inductor, routing off), `default_again` (the same, compiled a second time:
the spread between identical variants, which a ratio to `default` must exceed to mean
anything; NOTES.md step 68), `max_autotune` (Inductor's GEMM autotuning,
routing off), `routed` (every GEMM the lowering takes goes to the kernel: policy "all",
the op call), `routed_inline` (the same, the kernel itself in the generated code),
`routed_fused` (`routed` with epilogue fusion: a GEMM and its activation, or a GLU's product,
as one op call), `routed_auto` (epilogue fusion under policy "auto": only the GEMMs, fused or
not, the kernel is predicted to run at least as fast as Inductor's choice).
Steps: `forward` (inference, no_grad) and `train` (forward + backward, no optimizer).
`--graphs on` compiles with CUDA graphs (Inductor's cudagraph trees, as mode="reduce-overhead").

Each variant is compiled once, with a backend of its own (torch.compile keeps one compiled
entry per backend), and warmed up; then --trials trials, the variants in rotating order, each
timing --steps-per-trial back-to-back steps (more where those take under 20 ms: the row's
steps_per_trial) between two CUDA events. With --held H another
stream holds H whole SMs for each whole timed window (benchmarks/sm_hog.py); a window the
hog did not cover is redone longer. Rows: per-step milliseconds (p20 / p50 / p80 over
trials), the ratio to `default` (above 1: faster), the kernels one step launches (counted by
the profiler; of them, work-stealing GEMMs; each kernel's name, launches and GPU
microseconds go to the run's metadata, the JSON beside the CSV), and the output's relative
error against `default`'s (0 where every kernel's bits agree). --smoke runs tiny fp32 models
on the CPU (routing through Triton's interpreter): the plumbing only.
"""

import argparse
import collections
import dataclasses
import math
import pathlib
import time

import torch
import torch.nn.functional as F

import tritonblas_ops
from benchmarks import measure, results, sm_hog
from tritonblas_ops import settings
from tritonblas_ops.testing import rel_error

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is a nicety
    def tqdm(iterable, **_):
        return iterable

VARIANTS = ("default", "default_again", "max_autotune", "routed", "routed_inline", "routed_fused", "routed_auto")
STEPS = ("forward", "train")
SAFETY = 2.0  # hog duration over the expected window, in its slowest (held) case
MIN_WINDOW_MS = 20.0  # a trial's steps take at least this long (steps_per_trial)
# Steps profiled per variant, after its trials (a warm GPU): one step profiled right after
# compiling summed the same kernels up to 10% apart between two variants (NOTES.md step 65)
PROFILED_STEPS = 5
ATTEMPTS = 4
# The kernels of the GEMM (the Triton one and the warp-specialized one) and the grouped GEMM
WS_KERNELS = ("ws_matmul_kernel", "warp_specialized_matmul_kernel", "ws_grouped_kernel")


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    batch: int
    seq: int
    cache: int = 0  # decode: the KV cache's tokens; 0: a full sequence, causal


MODELS = {
    "gpt2_mlp": Shape(hidden=768, heads=12, kv_heads=12, ffn=3072, batch=8, seq=1024),
    "llama_small": Shape(hidden=1024, heads=16, kv_heads=16, ffn=2816, batch=4, seq=1024),
    "llama_8b": Shape(hidden=4096, heads=32, kv_heads=8, ffn=14336, batch=4, seq=2048),
    "decode_8b_t1": Shape(hidden=4096, heads=32, kv_heads=8, ffn=14336, batch=1, seq=1, cache=2048),
    "decode_8b_t16": Shape(hidden=4096, heads=32, kv_heads=8, ffn=14336, batch=16, seq=1, cache=2048),
}
SMOKE_MODELS = {
    "gpt2_mlp": Shape(hidden=32, heads=2, kv_heads=2, ffn=64, batch=2, seq=8),
    "llama_small": Shape(hidden=32, heads=4, kv_heads=2, ffn=48, batch=2, seq=8),
    "decode_8b_t1": Shape(hidden=32, heads=4, kv_heads=2, ffn=48, batch=1, seq=1, cache=8),
}


class GPT2MLP(torch.nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.fc = torch.nn.Linear(shape.hidden, shape.ffn)
        self.proj = torch.nn.Linear(shape.ffn, shape.hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LlamaBlock(torch.nn.Module):
    """Pre-norm attention (grouped key/value heads) and SwiGLU MLP, bias-free projections.
    With shape.cache, the new tokens attend to a KV cache (a decode step) before themselves."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        head_dim = shape.hidden // shape.heads
        self.attention_norm = RMSNorm(shape.hidden)
        self.q = torch.nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.k = torch.nn.Linear(shape.hidden, shape.kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(shape.hidden, shape.kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.mlp_norm = RMSNorm(shape.hidden)
        self.gate = torch.nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.up = torch.nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.down = torch.nn.Linear(shape.ffn, shape.hidden, bias=False)
        cache = (shape.batch, shape.kv_heads, shape.cache, head_dim)
        self.register_buffer("k_cache", torch.randn(cache) * 0.1, persistent=False)
        self.register_buffer("v_cache", torch.randn(cache), persistent=False)

    def forward(self, x):
        s = self.shape
        batch, seq, _ = x.shape
        head_dim = s.hidden // s.heads

        def heads(t, count):
            return t.view(batch, seq, count, head_dim).transpose(1, 2)

        h = self.attention_norm(x)
        q, k, v = heads(self.q(h), s.heads), heads(self.k(h), s.kv_heads), heads(self.v(h), s.kv_heads)
        if s.cache:
            k, v = torch.cat([self.k_cache, k], dim=2), torch.cat([self.v_cache, v], dim=2)
        repeat = s.heads // s.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=not s.cache)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, s.hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def build(name: str, shape: Shape, dtype, device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT2MLP(shape) if name.startswith("gpt2") else LlamaBlock(shape)
    return model.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Variants: one backend each
# ---------------------------------------------------------------------------------------


def backend(variant: str, graphs: bool):
    """An Inductor backend that compiles under this variant's routing settings and config,
    the lazily compiled backward included (compile_fx applies config_patches to it)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    routed = variant.startswith("routed")
    state = dict(enabled=routed, policy="auto" if variant == "routed_auto" else "all",
                 path="inline" if variant == "routed_inline" else "opaque",
                 fuse_epilogues=variant in ("routed_fused", "routed_auto"))
    patches = {"max_autotune": variant == "max_autotune", "triton.cudagraphs": graphs}

    def inner_compile(*args, **kwargs):
        with settings.routing(**state):
            return compile_fx_inner(*args, **kwargs)

    def compile_variant(gm, example_inputs):
        with settings.routing(**state):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)

    compile_variant.__name__ = f"inductor_{variant}{'_graphs' if graphs else ''}"
    return compile_variant


def step_fn(model, compiled, x, grad, step: str, graphs: bool):
    def forward():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return compiled(x)

    def train():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # As a training loop's zero_grad after its optimizer step: under CUDA graphs a
        # parameter's .grad is the previous replay's output, overwritten by this one, so
        # backward must not accumulate into it.
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.backward(grad)
        return out

    return forward if step == "forward" else train


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelRow(results.RunFields):
    model: str
    step: str  # forward | train
    variant: str
    cuda_graphs: bool
    held_sms: int
    steps_per_trial: int
    p20_ms: float
    p50_ms: float
    p80_ms: float
    vs_default: float | None = None  # default's p50 / this p50: above 1, faster
    kernels_per_step: int | float | None = None  # over PROFILED_STEPS steps
    ws_kernels_per_step: int | float | None = None
    rel_err: float | None = None  # of one step's output against default's


def window_ms(step, steps: int, held: int, hold_ms: float, streams) -> float | None:
    """Milliseconds of `steps` back-to-back steps; None if a hog did not cover them."""
    hog_stream, step_stream = streams
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    hog = sm_hog.hold_sms(held, hold_ms, hog_stream) if held else None
    with torch.cuda.stream(step_stream):
        start.record()
        for _ in range(steps):
            step()
        end.record()
    end.synchronize()
    if hog is not None:
        covered = hog.active()
        hog.check_distinct_sms()
        if not covered:
            return None
    return start.elapsed_time(end)


def cpu_window_ms(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e3


def step_kernels(step, steps: int = PROFILED_STEPS) -> dict[str, list]:
    """The kernels a step launches, by name, as the profiler sees them over `steps` steps:
    [launches, GPU microseconds] each, per step (where a step's time goes: the decode
    step's, say)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return tally_kernels(prof.events(), steps)


def tally_kernels(events, steps: int = 1) -> dict[str, list]:
    """Per kernel name of the profiler's GPU events: [launches, microseconds] per step of
    the `steps` the events span."""
    launches, us = collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            launches[e.name] += 1
            us[e.name] += e.time_range.elapsed_us()
    return {name: [_per_step(count, steps), round(us[name] / steps, 1)] for name, count in launches.items()}


def _per_step(count: int, steps: int) -> int | float:
    return count // steps if count % steps == 0 else round(count / steps, 2)


def measure_case(name: str, shape: Shape, step: str, graphs: bool, args, env) -> list[ModelRow]:
    """Rows of every variant and every --held value: the variants compiled once."""
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    # Earlier cases' compiled entries would count against the recompile limit of the blocks'
    # shared forward code (past it torch.compile runs the frame eagerly): start afresh.
    torch._dynamo.reset()
    model = build(name, shape, dtype, device)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    return measure_model(name, model, x, grad, step, graphs, args, env)


def measure_model(name: str, model: torch.nn.Module, x, grad, step: str, graphs: bool, args,
                  env) -> list[ModelRow]:
    """Rows of `model` on input x (grad: the output's gradient, for a training step) for every
    variant of args.variants and every held count of args.held (also args.trials and
    args.steps_per_trial): each variant compiled once. benchmarks/grouped.py's MoE layer
    comes in here too."""
    device = x.device
    steps, outputs = {}, {}
    for variant in args.variants:
        compiled = torch.compile(model, backend=backend(variant, graphs))
        steps[variant] = step_fn(model, compiled, x, grad, step, graphs)
        for _ in range(3):  # compiles (the backward at the first .backward()) and warms up
            out = steps[variant]()
        outputs[variant] = out.detach().clone()
        model.zero_grad(set_to_none=True)
    reference = outputs.get("default")

    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if device.type == "cuda" else None
    unheld = {v: window_ms(steps[v], 1, 0, 0, streams) for v in steps} if streams else {}
    per_trial = steps_per_trial(args.steps_per_trial, min(unheld.values()) if unheld else None)
    times = {}
    for held in args.held:
        times[held] = _trials(steps, held, unheld, streams, per_trial, args, env, name)
        model.zero_grad(set_to_none=True)
    counts = {}
    for variant in steps:
        names = step_kernels(steps[variant]) if device.type == "cuda" else None
        model.zero_grad(set_to_none=True)
        # The run's metadata keeps the names: what a variant launches besides the GEMMs.
        env.setdefault("kernels", {})[f"{name}/{step}/graphs {'on' if graphs else 'off'}/{variant}"] = names
        ws_names = [k for k in names or () if any(kernel in k for kernel in WS_KERNELS)]
        counts[variant] = ((sum(n for n, _ in names.values()), sum(names[k][0] for k in ws_names))
                           if names is not None else (None, None))
    return [row for held in args.held
            for row in _rows(times[held], counts, outputs, reference, name, step, graphs, held, per_trial, args, env)]


def steps_per_trial(requested: int, step_ms: float | None) -> int:
    """The requested steps per trial, or more to make a window of MIN_WINDOW_MS (step_ms:
    one unheld step of the case's fastest variant; None on the CPU): windows of a few
    host-bound steps spread by up to ~9% between identical variants (NOTES.md step 62)."""
    if step_ms is None:
        return requested
    return max(requested, math.ceil(MIN_WINDOW_MS / step_ms))


def _trials(steps: dict, held: int, unheld: dict, streams, per_trial: int, args, env, name: str) -> dict:
    """Per-step milliseconds of each variant, one sample per trial, variants rotating."""
    waves = env["num_sms"] / (env["num_sms"] - held) if streams else 1
    times = {v: [] for v in steps}
    for trial in range(args.trials):
        order = list(steps)[trial % len(steps):] + list(steps)[:trial % len(steps)]
        for variant in order:
            if streams is None:
                times[variant].append(cpu_window_ms(steps[variant], per_trial) / per_trial)
                continue
            hold_ms = SAFETY * per_trial * unheld[variant] * waves
            for _ in range(ATTEMPTS):
                window = window_ms(steps[variant], per_trial, held, hold_ms, streams)
                if window is not None:
                    break
                hold_ms *= 2
            else:
                raise RuntimeError(f"{name} {variant}: no window covered by the hog in {ATTEMPTS} attempts")
            times[variant].append(window / per_trial)
    return times


def _rows(times, counts, outputs, reference, name, step, graphs, held, per_trial, args, env) -> list[ModelRow]:
    rows = []
    for variant, samples in times.items():
        p20, p50, p80 = measure.quantiles(samples)
        kernels, ws_kernels = counts[variant]
        rows.append(ModelRow(
            **results.run_fields(env), model=name, step=step, variant=variant,
            cuda_graphs=graphs, held_sms=held, steps_per_trial=per_trial,
            p20_ms=p20, p50_ms=p50, p80_ms=p80,
            kernels_per_step=kernels, ws_kernels_per_step=ws_kernels,
            rel_err=rel_error(outputs[variant], reference) if reference is not None else None,
        ))
    base = next((r.p50_ms for r in rows if r.variant == "default"), None)
    for r in rows:
        r.vs_default = base / r.p50_ms if base else None
    return rows


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def keep_every_variant_compiled() -> None:
    """One compiled entry per variant of a case, all kept (measure_case() resets between
    cases); past the recompile limit torch.compile would run a variant eagerly, and this
    would time that: fail instead."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True


def _csv_list(kind, choices=None):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v]
        unknown = [v for v in values if choices is not None and v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{unknown} not among {sorted(choices)}")
        return values
    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=_csv_list(str, MODELS), default=list(MODELS))
    parser.add_argument("--variants", type=_csv_list(str, VARIANTS), default=["default", "routed"])
    parser.add_argument("--steps", type=_csv_list(str, STEPS), default=list(STEPS))
    parser.add_argument("--graphs", type=_csv_list(str, ("off", "on")), default=["off", "on"])
    parser.add_argument("--held", type=_csv_list(int), default=[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps-per-trial", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 models on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models = [m for m in args.models if m in SMOKE_MODELS]
        args.graphs, args.held = ["off"], [0]
        tritonblas_ops.route_cpu(True)
    keep_every_variant_compiled()

    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    env = results.environment(device, vars(args))
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['timestamp']}")
    shapes = SMOKE_MODELS if args.smoke else MODELS
    cases = [(name, step, graphs == "on") for name in args.models for step in args.steps
             for graphs in args.graphs if not (step == "train" and shapes[name].cache)]
    rows = []
    for name, step, graphs in tqdm(cases, unit="case"):
        case_rows = measure_case(name, shapes[name], step, graphs, args, env)
        rows += case_rows
        if args.out and case_rows:  # as it goes: a run stopped at a time limit keeps its rows
            results.append(args.out, case_rows, env)
    print(table(rows))
    if args.out:
        print(f"appended {len(rows)} rows to {args.out}")


def table(rows: list[ModelRow]) -> str:
    width = max([15, *(len(r.model) + 2 for r in rows)])  # the longest name and two spaces
    lines = [f"{'model':<{width}}{'step':<9}{'graphs':<8}{'held':>5}  {'variant':<15}{'ms/step':>10}"
             f"{'vs default':>12}{'kernels':>9}{'ws':>5}{'rel err':>10}"]
    for r in rows:
        lines.append(
            f"{r.model:<{width}}{r.step:<9}{'on' if r.cuda_graphs else 'off':<8}{r.held_sms:>5}  "
            f"{r.variant:<15}{r.p50_ms:>10.3f}{r.vs_default or float('nan'):>12.3f}"
            f"{'' if r.kernels_per_step is None else r.kernels_per_step:>9}"
            f"{'' if r.ws_kernels_per_step is None else r.ws_kernels_per_step:>5}"
            f"{r.rel_err if r.rel_err is not None else float('nan'):>10.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

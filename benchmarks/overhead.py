"""Host cost of one eager call: torch.ops.tritonblas.ws_mm against torch.mm on a tiny GEMM,
where the GPU work is a few microseconds and the host path is what a user waits for; and
the ops routing puts in place of addmm (ws_addmm) and of addmm + tanh GELU (ws_mm_act),
against those: what a routed GEMM adds to a compiled step without CUDA graphs."""

import time

import torch

import tritonblas_ops  # noqa: F401  registers torch.ops.tritonblas
from benchmarks import measure
from benchmarks.providers import TORCH_MM, WORK_STEALING
from tritonblas_ops import fastpath, is_checked, set_checked, ws_matmul
from tritonblas_ops.device import default_num_shards

SIZE = 64
WARMUP_CALLS = 20
PYTHON_OP_FLOOR = "python_op_floor"

# An op whose CPU and CUDA kernels are a Python function that only allocates the output:
# what any op with a Python kernel pays for the dispatcher's way into Python and back on
# this host before doing any work, the floor under ws_op's host time.
_FLOOR_LIBRARY = torch.library.Library("tritonblas_bench", "DEF")
_FLOOR_LIBRARY.define("empty_mm(Tensor a, Tensor b) -> Tensor")


def _empty_mm(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


for _key in ("CPU", "CUDA"):
    _FLOOR_LIBRARY.impl("empty_mm", _empty_mm, _key)


_rows: dict = {}  # (device, dtype, columns) -> a bias row, made once


def _bias(a, b) -> torch.Tensor:
    key = (a.device, a.dtype, b.shape[1])
    if key not in _rows:
        _rows[key] = torch.randn(b.shape[1], dtype=a.dtype, device=a.device)
    return _rows[key]


def providers() -> dict:
    """name -> f(a, b). `ws` is the Python entry point under the op, to split the op's
    dispatch cost from the launcher's; `ws_uncached` passes a knob (the default shard
    count), which skips the cached plan: every decision and Triton's own launch, each call;
    `ws_checked` is a checked launch (a synchronization and two counter read-backs each);
    `python_op_floor` launches nothing (above); `ws_addmm_op` and `ws_mm_act_op` (bias, tanh
    GELU) beside their counterparts (providers.OVERHEAD_BASELINES). With
    TRITONBLAS_OPS_FAST_PATHS=0 the ws names end in `_public`: every call then takes the
    public APIs (fastpath.py)."""
    suffix = "" if fastpath.ENABLED else "_public"
    return {
        TORCH_MM: torch.mm,
        PYTHON_OP_FLOOR: torch.ops.tritonblas_bench.empty_mm,
        "ws_op" + suffix: torch.ops.tritonblas.ws_mm,
        WORK_STEALING + suffix: ws_matmul,
        "ws_uncached" + suffix: lambda a, b: ws_matmul(a, b, num_shards=default_num_shards(a.device)),
        "ws_checked" + suffix: _checked_call,
        "torch_addmm": lambda a, b: torch.addmm(_bias(a, b), a, b),
        "ws_addmm_op" + suffix: lambda a, b: torch.ops.tritonblas.ws_addmm(_bias(a, b), a, b),
        "addmm_gelu": lambda a, b: torch.nn.functional.gelu(torch.addmm(_bias(a, b), a, b), approximate="tanh"),
        "ws_mm_act_op" + suffix: lambda a, b: torch.ops.tritonblas.ws_mm_act(a, b, _bias(a, b),
                                                                              activation="gelu_tanh"),
    }


def _checked_call(a, b):
    before = is_checked()
    set_checked(True)
    try:
        return ws_matmul(a, b)
    finally:
        set_checked(before)


def us_per_call(fns: dict, a, b, *, calls_per_trial: int, trials: int) -> dict:
    """name -> (p20, p50, p80) over trials of wall microseconds per call: `calls_per_trial`
    calls with no sync between them, one sync at the end. The providers take turns, one
    trial each, so a host whose speed drifts (clocks, other tenants) weighs on all of them
    alike. If the GPU were slower than the host this would measure the GPU; at 64^3 the
    host is the slower side."""
    for fn in fns.values():
        for _ in range(WARMUP_CALLS):
            fn(a, b)
    _sync(a.device)
    samples = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls_per_trial):
                fn(a, b)
            _sync(a.device)
            samples[name].append((time.perf_counter() - start) / calls_per_trial * 1e6)
    return {name: measure.quantiles(times) for name, times in samples.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

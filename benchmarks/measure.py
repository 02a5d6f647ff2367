"""Timing and the correctness gate every provider passes before it is timed."""

import time
from typing import Callable

import torch

from tritonblas_ops import testing

QUANTILES = (0.2, 0.5, 0.8)

# Relative Frobenius error against float64 that the gate lets through, per input dtype (fp32
# runs as TF32 on the GPU). Looser than tritonblas_ops.testing.REL_TOLERANCE, the kernel's
# contract that the tests hold: the gate also passes the baselines, which may reduce in
# lower precision (cuBLAS split-K under allow_{fp16,bf16}_reduced_precision_reduction,
# Inductor's decompose-K), and it only has to stop broken outputs, which miss by orders of
# magnitude. Every row records the error measured, to hold against the contract.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-2}

# Output rows the float64 reference computes: enough to cover every tile row of a large
# GEMM at 128-row tiles, few enough that the reference stays cheap next to the GEMM.
REFERENCE_ROWS = 256

MIN_CPU_REPS = 3


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float,
            rep_ms: float) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of one call of fn.

    On the GPU this is triton.testing.do_bench: CUDA events around each call and a 256 MB
    write before each one, so every call starts with a cold L2. Only the keywords that
    triton 3.6 and 3.8 share are passed; with `quantiles` both return a list.
    On the CPU (--smoke) it is perf_counter around each call, at least MIN_CPU_REPS calls.
    """
    if device.type == "cuda":
        import triton.testing

        return tuple(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES)))
    return _cpu_time_ms(fn, rep_ms)


def _cpu_time_ms(fn, rep_ms):
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < MIN_CPU_REPS or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return quantiles(times)


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(q.tolist())


def reference_rows(m: int) -> torch.Tensor:
    """Evenly spaced output rows, always with the last one (it sits in the ragged edge tile)."""
    step = max(1, m // REFERENCE_ROWS)
    return torch.unique(torch.cat([torch.arange(0, m, step), torch.tensor([m - 1])]))


def matmul_ref(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 (a @ b)[rows], by the reference the tests use."""
    return testing.matmul_ref(a[rows.to(a.device)], b)


def poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Make the next output allocation of `numel` elements come back full of NaN.

    The providers allocate their own outputs. With the cache emptied, the NaN block freed
    here is the only cached block of that size, so the caching allocator hands it to the
    provider's output (not an earlier provider's output, which holds the right answer):
    any element the provider forgets to write reads NaN and fails the check. (On the CPU
    the allocator may not reuse it; the float64 comparison still catches garbage.)
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.empty(numel, dtype=dtype, device=device).fill_(float("nan"))


def check(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, tolerance: float, what: str) -> float:
    """Relative error of out[rows] against ref; raises, saying where, past tolerance.

    The whole output must be finite (catches unwritten tiles outside the sampled rows).
    """
    finite = torch.isfinite(out)
    if not finite.all():
        bad = (~finite).nonzero()
        raise AssertionError(f"{what}: {len(bad)} non-finite outputs, first at (row, col) "
                             f"{tuple(bad[0].tolist())}")
    sampled = out[rows.to(out.device)]
    error = testing.rel_error(sampled, ref)
    if not error <= tolerance:
        index, col = divmod((sampled.double() - ref).abs().argmax().item(), ref.shape[1])
        row = rows[index].item()
        raise AssertionError(
            f"{what}: relative error {error:.3g} > {tolerance:g}; worst at (row, col) ({row}, {col}): "
            f"got {out[row, col].item():.6g}, expected {ref[index, col].item():.6g}"
        )
    return error

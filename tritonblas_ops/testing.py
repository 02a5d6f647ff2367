"""The float64 reference, tolerances and comparison helpers shared by tests and benchmarks."""

import torch

from tritonblas_ops import launch
from tritonblas_ops.config import TileConfig
from tritonblas_ops.plan import Knobs, Schedule


def matmul_ref(a, b, bias=None, *, alpha=1.0, beta=1.0):
    """alpha * a @ b + beta * bias in float64 (on the inputs' device)."""
    out = alpha * torch.matmul(a.double(), b.double())
    if bias is not None and beta != 0:
        out = out + beta * bias.double()
    return out


# Largest relative-norm error ||out - ref|| / ||ref|| accepted against the float64 reference
# of the same (already rounded) inputs. Output rounding alone costs about 2**-mantissa_bits:
# 2.4e-4 for fp16, 2e-3 for bf16; TF32 rounds the inputs to 10 mantissa bits (~3e-4).
REL_TOLERANCE = {
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    torch.float32: 1e-5,  # IEEE fp32 (the CPU interpreter, or TF32 off)
    "tf32": 2e-3,
}


def matmul_magnitude(a, b, bias=None, *, alpha=1.0, beta=1.0):
    """|alpha| |a| @ |b| + |beta| |bias| in float64: the size of the terms a GEMM sums, which
    bounds its rounding error even where they cancel."""
    return matmul_ref(a.abs(), b.abs(), None if bias is None else bias.abs(), alpha=abs(alpha), beta=abs(beta))


def rel_error(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    ref = ref.double()
    diff = out.double() - ref
    norm = (ref if scale is None else scale.double()).norm()
    return (diff.norm() / norm.clamp_min(1e-30)).item()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, tolerance: float,
                   scale: torch.Tensor | None = None) -> None:
    """Fails on any NaN/Inf (outputs are poisoned with NaN before tests) or on a relative-norm
    error above `tolerance`, saying where the worst element is. `scale` (matmul_magnitude):
    the error relative to the terms' size instead of the result's, for random problems
    small enough that their few terms can cancel."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    finite = torch.isfinite(out)
    if not finite.all():
        where = (~finite).nonzero()[:5].tolist()
        raise AssertionError(f"{(~finite).sum().item()} non-finite outputs, first at {where}")
    err = rel_error(out, ref, scale)
    if not err <= tolerance:
        worst = (out.double() - ref.double()).abs().argmax()
        index = list(torch.unravel_index(worst, out.shape))
        raise AssertionError(
            f"relative error {err:.3e} > {tolerance:.1e}; worst at {[int(i) for i in index]}: "
            f"{out.flatten()[worst].item()} vs {ref.flatten()[worst].item()}"
        )


def assert_every_unit_computed_once(a: torch.Tensor, b: torch.Tensor, config: TileConfig, *,
                                    num_shards: int, num_programs: int, schedule: Schedule,
                                    tolerance: float) -> None:
    """Launches the kernel twice on (B, M, K) @ (B, K, N), on one counter buffer, with a
    counter per work unit: every unit is computed exactly once, the result is right, and
    the counters are left at zero for the next launch (WorkQueue.problems)."""
    knobs = Knobs(config, num_shards, num_programs, schedule)
    plan = launch.plan_for(a, b, None, 1.0, 1.0, knobs)
    queue = plan.queue
    counters = torch.zeros(queue.numel, dtype=torch.int32, device=a.device)
    for _ in range(2):
        unit_counts = torch.zeros(queue.product_units, dtype=torch.int32, device=a.device)
        out = torch.full(plan.out_shape, float("nan"), dtype=a.dtype, device=a.device)
        a_arg, b_arg, _, partials = launch.operands(plan, a, b, None)
        launch.launch_kernel(plan, a_arg, b_arg, out, None, counters, partials, 1.0, 1.0,
                             unit_counts=unit_counts)
        assert (unit_counts == 1).all(), f"unit counts {unit_counts.unique(return_counts=True)}"
        assert_matches(out, matmul_ref(a, b), tolerance)
        problems = queue.problems(counters.tolist(), tally=queue.num_units if plan.checked else 0)
        assert not problems, f"{problems} (queue {queue}, {num_programs} programs)"
        counters[queue.tally_offset] = 0  # a checked launch's tally, for the next launch

"""Fused epilogues that read an output-sized operand, eager and alone: what a gate or a
residual read in the kernel's epilogue costs beyond the plain GEMM, against cuBLAS and the
pointwise kernel eager PyTorch runs after it.

    python -m benchmarks.epilogues [--shapes 8192x3072x768,...]
    python -m benchmarks.epilogues --smoke    # CPU, the interpreter, fp32, one tiny shape

Per shape (bf16, row-major operands, an (M, N) gate/residual), microseconds of GPU time per
call (the median, L2 flushed before each call, from CUDA-graph replays taken in turn:
benchmarks/measure.py, as the GEMM tables):
  mm            torch.mm (cuBLAS)
  ws_mm         torch.ops.tritonblas.ws_mm
  gated         ws_mm_gated(a, b, g, activation="silu"): silu(g) * (a @ b), SwiGLU's product
  gated_dgelu   ws_mm_gated(..., activation="d_gelu"): GELU's slope at g times the product
  addmm_res     ws_addmm(g, a, b): a residual added in the epilogue
  torch_addmm   torch.addmm(g, a, b)
  eager_gated   silu(g) * torch.mm(a, b): cuBLAS, then the pointwise kernel
and the gated product's relative error against float64. policy.EPILOGUE_OPERAND_GBPS comes
from these rows: the operand's bytes over (fused - ws_mm).
"""

import argparse

import torch
import triton

import tritonblas_ops  # noqa: F401  registers torch.ops.tritonblas
from benchmarks.measure import time_ms
from tritonblas_ops.testing import rel_error

SHAPES = "8192x3072x768,8192x768x3072,8192x14336x4096,8192x4096x14336,8192x4096x4096"
SMOKE_SHAPES = "48x40x32"


def measure(m: int, n: int, k: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
            rep_ms: float = 100) -> tuple[dict, float]:
    """Microseconds per call of each way (the docstring's list) and the gated product's
    relative error against float64."""
    ops = torch.ops.tritonblas
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    g = torch.randn(m, n, device=device, dtype=dtype)
    reference = torch.nn.functional.silu(g.double()) * (a.double() @ b.double())
    out = ops.ws_mm_gated(a, b, g, activation="silu")
    error = rel_error(out, reference)
    fns = dict(mm=lambda: torch.mm(a, b), ws_mm=lambda: ops.ws_mm(a, b),
               gated=lambda: ops.ws_mm_gated(a, b, g, activation="silu"),
               gated_dgelu=lambda: ops.ws_mm_gated(a, b, g, activation="d_gelu"),
               addmm_res=lambda: ops.ws_addmm(g, a, b), torch_addmm=lambda: torch.addmm(g, a, b),
               eager_gated=lambda: torch.nn.functional.silu(g) * torch.mm(a, b))
    times = time_ms(fns, a.device, warmup_ms=25, rep_ms=rep_ms)
    return {name: p50 * 1e3 for name, (_, p50, _) in times.items()}, error


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help=f"MxNxK, comma-separated (default {SHAPES}; --smoke: {SMOKE_SHAPES})")
    parser.add_argument("--smoke", action="store_true", help="CPU through the interpreter, fp32: the plumbing only")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks.epilogues needs a CUDA GPU (--smoke runs on the CPU)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    device_name = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(device_name, "torch", torch.__version__, "triton", triton.__version__)
    for shape in (args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)).split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        times, error = measure(m, n, k, device, dtype, rep_ms=1 if args.smoke else 100)
        operand_bytes = dtype.itemsize * m * n
        rates = {name: operand_bytes / (times[name] - times["ws_mm"]) / 1e3
                 for name in ("gated", "gated_dgelu", "addmm_res") if times[name] > times["ws_mm"]}
        print(f"{shape} err {error:.1e} " + " ".join(f"{name}={us:.1f}" for name, us in times.items())
              + " | operand GB/s " + " ".join(f"{name}={rate:.0f}" for name, rate in rates.items()), flush=True)


if __name__ == "__main__":
    main()

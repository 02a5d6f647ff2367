"""python -m tritonblas_ops.demo: the work-stealing GEMM, called directly and inside a
compiled model, forward and backward.

On a GPU: 4096^3 in bf16, timed against torch.mm (cuBLAS). Without one: small fp32 sizes,
the same kernel run by Triton's interpreter (CPU GEMMs routed with route_cpu(True)).
"""

import re

import torch
from torch._inductor.utils import run_and_get_code

import tritonblas_ops
from tritonblas_ops.testing import matmul_ref, rel_error

ROUTED = re.compile(r"torch\.ops\.tritonblas\.ws_\w+|ws_matmul_kernel_\d+\.run")


def direct_call(device: str, dtype: torch.dtype, size: int) -> None:
    print(f"Calling torch.ops.tritonblas.ws_mm on {device} "
          f"({'compiling the kernel' if device == 'cuda' else 'interpreting it'}; a few seconds)...",
          flush=True)
    a = torch.randn(size, size + 8, device=device, dtype=dtype)
    b = torch.randn(size + 8, size - 8, device=device, dtype=dtype)
    out = torch.ops.tritonblas.ws_mm(a, b)
    print(f"ws_mm {tuple(a.shape)} @ {tuple(b.shape)}, {dtype}, {device}: "
          f"relative error against float64 {rel_error(out, matmul_ref(a, b)):.1e}, "
          f"bitwise reproducible: {torch.equal(out, torch.ops.tritonblas.ws_mm(a, b))}")
    if device == "cuda":
        import triton.testing

        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        for name, fn in [("torch.mm (cuBLAS)", torch.mm), ("ws_mm", torch.ops.tritonblas.ws_mm)]:
            ms = triton.testing.do_bench(lambda: fn(a, b), return_mode="median")
            print(f"  {name:18s} {flops / ms / 1e9:6.0f} TFLOP/s")


def compiled_model(device: str, dtype: torch.dtype, width: int) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),  # addmm: bias in the kernel's epilogue
        torch.nn.GELU(),
        torch.nn.Linear(2 * width, width, bias=False),  # mm
    ).to(device, dtype)
    x = torch.randn(3 * width, width, device=device, dtype=dtype)
    compiled = torch.compile(model)

    def train_step():
        out = compiled(x)
        out.sum().backward()
        return out

    print("Compiling an MLP with torch.compile and running a training step (the first "
          "compile takes about 20 s), policy 'all': every GEMM routed, where the default "
          "policy 'auto' routes only those measured to run faster...", flush=True)
    # One capture for both graphs: on a warm cache the backward loads with the forward.
    with tritonblas_ops.routing(policy="all"):
        out, (forward_code, backward_code) = run_and_get_code(train_step)
    eager = model(x)
    print(f"compiled MLP: {len(ROUTED.findall(forward_code))} GEMMs routed to the kernel "
          f"forward, {len(ROUTED.findall(backward_code))} backward; relative difference "
          f"from eager {rel_error(out.detach(), eager.detach()):.1e}")


def main() -> None:
    if torch.cuda.is_available():
        device, dtype, size, width = "cuda", torch.bfloat16, 4096, 1024
    else:
        device, dtype, size, width = "cpu", torch.float32, 72, 32
        tritonblas_ops.route_cpu(True)  # compiled CPU GEMMs reach the kernel too
        print("No GPU: the kernel runs through Triton's interpreter on small sizes.")
    print(f"routing enabled: {tritonblas_ops.is_enabled()}, policy: {tritonblas_ops.get_policy()}")
    direct_call(device, dtype, size)
    compiled_model(device, dtype, width)


if __name__ == "__main__":
    main()

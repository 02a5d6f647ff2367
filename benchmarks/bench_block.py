"""A Llama-style transformer block under torch.compile: GEMMs routed to the kernel vs Inductor's.

    python -m benchmarks.bench_block [--path opaque|inline] [--iters 50]

bf16 on the GPU; batch 4, sequence 512, hidden 2048, 16 heads, SwiGLU FFN 5632: seven GEMMs
forward (q, k, v, o, gate, up, down), fourteen backward. Each variant is compiled fresh, its
backward compiled inside the same routing state, then timed right away: the forward alone and
forward + backward, CUDA events around each call, the median of --iters calls. Prints
milliseconds and the ratio default / routed (above 1: routing is faster).
"""

import argparse
import datetime
import statistics

import torch
import torch.nn.functional as F
import triton

import tritonblas_ops
from benchmarks.models import RMSNorm
from tritonblas_ops import settings

BATCH, SEQ, HIDDEN, HEADS, FFN = 4, 512, 2048, 16, 5632


class LlamaBlock(torch.nn.Module):
    """Pre-norm causal attention and SwiGLU MLP; every projection a bias-free nn.Linear."""

    GEMMS = 7  # q, k, v, o, gate, up, down; the backward has two per projection

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, ffn: int = FFN):
        super().__init__()
        self.heads = heads
        self.attention_norm = RMSNorm(hidden)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, hidden, bias=False)
        self.v = torch.nn.Linear(hidden, hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        batch, seq, hidden = x.shape

        def split_heads(t):
            return t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        h = self.attention_norm(x)
        q, k, v = split_heads(self.q(h)), split_heads(self.k(h)), split_heads(self.v(h))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_variant(block, x, grad, *, routed: bool, path: str, iters: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of the block compiled with routing on or off."""
    torch._dynamo.reset()  # a fresh compile, under this variant's routing settings
    compiled = torch.compile(block)
    with tritonblas_ops.routing(routed, path=path):
        for _ in range(3):  # compiles the forward, then (lazily) the backward; warms up
            compiled(x).backward(grad)
    torch.cuda.synchronize()
    forward = median_ms(lambda: compiled(x), iters)
    forward_backward = median_ms(lambda: compiled(x).backward(grad), iters)
    return forward, forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=["opaque", "inline"], default=None,
                        help="what a routed GEMM becomes (default: TRITONBLAS_OPS_ROUTING_PATH)")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    path = args.path or settings.current().path.value

    torch.manual_seed(0)
    block = LlamaBlock().cuda().to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    default = time_variant(block, x, grad, routed=False, path=path, iters=args.iters)
    routed = time_variant(block, x, grad, routed=True, path=path, iters=args.iters)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"routing path {path}, median of {args.iters}")
    print(f"block: batch {BATCH}, seq {SEQ}, hidden {HIDDEN}, heads {HEADS}, ffn {FFN}, bf16")
    print(f"{'':<18}{'default ms':>12}{'routed ms':>12}{'default/routed':>16}")
    for name, base, ours in zip(("forward", "forward+backward"), default, routed):
        print(f"{name:<18}{base:>12.3f}{ours:>12.3f}{base / ours:>16.3f}")


if __name__ == "__main__":
    main()

"""Whether an output element's bits depend on which operand the MMA takes as A: the premise
of batch-invariant mode's transposed decode tile (NOTES.md steps 69-70).

    python -m benchmarks.swap_bits [--shapes 1x4096x14336,...] [--smoke]

Batch-invariant launches of one (N, K) run different tiles for different M and must give
each row the same bits. 16-bit decode (M <= 16) solves C^T = B^T @ A^T on transposed tiles
(config.HALF_INVARIANT_DECODE_CONFIGS), more rows take unswapped ones. For each shape and
each M from 1 to the shape's M (16 by default) this computes C = A @ B through the
narrowest unswapped invariant tile and through every transposed one (those and normal
mode's, config.HALF_SWAPPED_CONFIGS), whole K (no split, no chunks), fresh random bf16
operands, and compares them bit for bit. Prints a line per shape and exits 1 where any
differ. --smoke: tiny fp32 shapes on the CPU (Triton's interpreter), the plumbing only.
"""

import argparse
import sys

import torch

from benchmarks import corpus
from tritonblas_ops.config import HALF_INVARIANT_CONFIGS, HALF_INVARIANT_DECODE_CONFIGS, HALF_SWAPPED_CONFIGS, TileConfig
from tritonblas_ops.launch import ws_matmul

# The narrowest unswapped invariant tile, and the transposed ones of both modes
UNSWAPPED = min(HALF_INVARIANT_CONFIGS, key=lambda config: config.block_n)
SWAPPED = tuple(dict.fromkeys([config for config, _ in HALF_INVARIANT_DECODE_CONFIGS] + list(HALF_SWAPPED_CONFIGS)))
SHAPES = "16x1024x4096,16x4096x4096,16x4096x14336,16x14336x4096,16x8192x28672"
SMOKE_SHAPES = "4x48x64"
SMOKE_UNSWAPPED = TileConfig(16, 16, 16, num_warps=4, num_stages=1)
SMOKE_SWAPPED = (TileConfig(16, 16, 16, num_warps=4, num_stages=1, swap_ab=True),)


def differing_rows(m_max: int, n: int, k: int, dtype, device, unswapped, swapped) -> list[str]:
    """'M=<rows> <tile>' for every row count 1..m_max and swapped tile whose C differs from
    the unswapped tile's in any bit."""
    b = torch.randn(k, n, dtype=dtype, device=device)
    differ = []
    for m in range(1, m_max + 1):
        a = torch.randn(m, k, dtype=dtype, device=device)
        reference = ws_matmul(a, b, config=unswapped)
        for config in swapped:
            if not torch.equal(ws_matmul(a, b, config=config), reference):
                differ.append(f"M={m} {config.block_m}x{config.block_n}")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swap_bits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help="MxNxK,...: M is the largest row count tried")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        unswapped, swapped = SMOKE_UNSWAPPED, SMOKE_SWAPPED
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        unswapped, swapped = UNSWAPPED, SWAPPED
    shapes = corpus.parse_shapes(args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES))
    torch.manual_seed(0)
    any_differ = False
    for shape in shapes:
        differ = differing_rows(shape.m, shape.n, shape.k, dtype, device, unswapped, swapped)
        any_differ |= bool(differ)
        verdict = f"differ: {', '.join(differ)}" if differ else "bitwise equal"
        print(f"{shape.m}x{shape.n}x{shape.k} (M = 1..{shape.m}): {verdict}")
    return 1 if any_differ else 0


if __name__ == "__main__":
    sys.exit(main())

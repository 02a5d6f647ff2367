"""Tile configurations: chosen analytically from the shape, never autotuned on the hot path."""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # output-tile rows per swizzle group, for L2 reuse of B's columns
    num_warps: int = 8
    num_stages: int = 3


# The interpreter runs each tl op in numpy: bigger tiles mean fewer, cheaper Python steps.
INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1)


def select_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """A tile shape for an (m, k) @ (k, n) GEMM.

    Large 16-bit GEMMs use the 128x256x64 tiles that matched cuBLAS on the H200
    (DESIGN.md 5); skinny M takes 64-row tiles so fewer rows are wasted on padding.
    """
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return TileConfig(128, 128, 32, num_warps=8, num_stages=3)
    if m <= 64:
        return TileConfig(64, 128, 64, num_warps=4, num_stages=4)
    return TileConfig(128, 256, 64, num_warps=8, num_stages=3)

"""Tile configurations: chosen analytically from the shape, never autotuned on the hot path."""

import dataclasses

import torch

from tritonblas_ops import device as devices


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

# 16-bit tiles, largest first, as measured on the H200 (benchmarks/NOTES.md, step 2):
# 128x256 is fastest wherever it yields a full wave of tiles (8192^3: 670-716 TFLOP/s
# against 636-640 for 128x128); below a wave, smaller tiles keep more SMs busy
# (1024x1024x16384: 393 with 64x128 against 215 with 128x256; 128x8192x8192: 277 vs 189).
HALF_CONFIGS = (
    TileConfig(128, 256, 64, num_warps=8, num_stages=3),
    TileConfig(128, 128, 64, num_warps=4, num_stages=4),
    TileConfig(64, 128, 64, num_warps=4, num_stages=4),
)
FP32_CONFIGS = (
    TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    TileConfig(64, 128, 32, num_warps=4, num_stages=4),
)


def num_tiles(m: int, n: int, batches: int, config: TileConfig) -> int:
    # Plain integer ceil-division: triton.cdiv is a jit function, ~4 us a host call.
    return -(-m // config.block_m) * -(-n // config.block_n) * batches


def select_config(m: int, n: int, k: int, batches: int, dtype: torch.dtype,
                  device: torch.device) -> TileConfig:
    """The largest tile that still gives every SM/CU a tile, else the smallest tile."""
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    candidates = FP32_CONFIGS if dtype == torch.float32 else HALF_CONFIGS
    units = devices.num_compute_units(device)
    for config in candidates:
        if num_tiles(m, n, batches, config) >= units:
            return config
    return candidates[-1]

"""What the benchmark compares: each provider turns (a, b) into a call computing a @ b."""

import dataclasses
import re
from typing import Callable

import torch

import tritonblas_ops
from tritonblas_ops import device as devices
from tritonblas_ops.config import TileConfig
from tritonblas_ops import Schedule, ws_matmul

TORCH_MM = "torch_mm"  # cuBLAS(Lt) on NVIDIA: the bar to meet
STATIC = "static"  # the same kernel and tile body, tiles assigned statically
WORK_STEALING = "ws"
INDUCTOR = "inductor"
TRITON_KERNEL = "ws_triton_kernel"
# Host-time providers (overhead.py) compared with Inductor's default counterpart, not torch.mm
OVERHEAD_BASELINES = {"ws_addmm_op": "torch_addmm", "ws_mm_act_op": "addmm_gelu"}


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    prepare: Callable[[torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]
    num_shards: int | None = None  # work-stealing counter shards, where there are any


def providers(device: torch.device, *, shards: list[int] | None, inductor: bool,
              configs: list[TileConfig] | None = None, triton_kernel: bool = False) -> list[Provider]:
    """torch.mm, the static schedule, work stealing (one row per shard count when `shards`
    is given, else the library's default count), one work-stealing row per forced tile
    config in `configs` (to calibrate select_config), optionally work stealing with the
    Triton kernel alone (the warp-specialized kernel off), and optionally Inductor."""
    chosen = [
        Provider(TORCH_MM, lambda a, b: lambda: torch.mm(a, b)),
        Provider(STATIC, lambda a, b: lambda: ws_matmul(a, b, schedule=Schedule.STATIC)),
    ]
    if shards:
        chosen += [_work_stealing(f"{WORK_STEALING}_s{s}", s) for s in shards]
    else:
        chosen.append(_work_stealing(WORK_STEALING, devices.default_num_shards(device)))
    chosen += [Provider(f"{WORK_STEALING}_{config_name(c)}",
                        lambda a, b, c=c: lambda: ws_matmul(a, b, config=c)) for c in configs or []]
    if triton_kernel:
        chosen.append(Provider(TRITON_KERNEL, _triton_kernel))
    if inductor:
        chosen.append(Provider(INDUCTOR, _compile_inductor))
    return chosen


def _triton_kernel(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """ws_matmul with the warp_specialize setting off for the call (plans are cached per setting)."""
    return lambda: without_warp_specialization(lambda: ws_matmul(a, b))


def without_warp_specialization(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """call() with the warp_specialize setting off, then the setting as it was."""
    before = tritonblas_ops.is_warp_specializing()
    tritonblas_ops.warp_specialize(False)
    try:
        return call()
    finally:
        tritonblas_ops.warp_specialize(before)


CONFIG_PATTERN = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)k(\d+)(?:c(\d+))?(r?)(t?)")


def config_name(config: TileConfig) -> str:
    """128x256x64w8s3k2: block M x N x K, warps, pipeline stages, K slices; then cC for K in
    C chunks (batch-invariant tiles), r for a split tail (only the tiles past the last whole
    wave split) and t for swap_ab (the transposed problem)."""
    return (f"{config.block_m}x{config.block_n}x{config.block_k}"
            f"w{config.num_warps}s{config.num_stages}k{config.split_k}"
            f"{f'c{config.k_chunks}' if config.k_chunks > 1 else ''}{'r' if config.split_tail else ''}"
            f"{'t' if config.swap_ab else ''}")


def parse_config(text: str) -> TileConfig:
    match = CONFIG_PATTERN.fullmatch(text)
    if match is None:
        raise ValueError(f"tile config {text!r} is not like 128x256x64w8s3k1 (block M x N x K, "
                         f"warps, stages, K slices; then optionally cC: K chunks, r: a split tail, t: swap_ab)")
    *numbers, chunks, tail, swap = match.groups()
    m, n, k, warps, stages, split = map(int, numbers)
    return TileConfig(m, n, k, num_warps=warps, num_stages=stages, split_k=split,
                      k_chunks=int(chunks or 1), split_tail=tail == "r", swap_ab=swap == "t")


def _work_stealing(name: str, num_shards: int) -> Provider:
    return Provider(name, lambda a, b: lambda: ws_matmul(a, b, num_shards=num_shards), num_shards)


def _compile_inductor(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Inductor max-autotune (Triton templates and aten) on this one static shape.

    Dynamo is reset and the function is new, so each shape compiles and autotunes on its
    own, never falling into a recompile limit or a dynamic-shape graph. Our compile routing
    would send the mm to our kernel: it is switched off for the compile and every call.
    """
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: torch.mm(x, y), mode="max-autotune-no-cudagraphs", dynamic=False)

    def call():
        with tritonblas_ops.routing(False):
            return compiled(a, b)

    return call

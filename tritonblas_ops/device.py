"""Facts about the device a GEMM runs on: compute units, XCDs, default shard count."""

import functools
import os

import torch

# Counters per launch: one int32 per shard, each on its own 256-byte line so that
# programs hammering different shards never contend for the same cache line.
COUNTER_STRIDE = 64

SHARDS_ENV = "TRITONBLAS_OPS_NUM_SHARDS"

# Programs the CPU interpreter runs (one after another); small, so tests stay fast.
INTERPRETER_PROGRAMS = 4


def is_hip() -> bool:
    return torch.version.hip is not None


@functools.cache
def _properties(index: int):
    # Always a torch.device, never the string "cuda": the string form once picked the
    # wrong device (tritonBLAS PR #65).
    return torch.cuda.get_device_properties(torch.device("cuda", index))


def has_tma(device: torch.device) -> bool:
    """Hopper and newer NVIDIA GPUs copy tiles with tensor descriptors (TMA)."""
    return device.type == "cuda" and not is_hip() and _properties(_index(device)).major >= 9


def has_wgmma(device: torch.device) -> bool:
    """Hopper's warpgroup MMA (sm_90 only: Blackwell's tensor cores take other instructions),
    which the warp-specialized kernel issues directly."""
    return device.type == "cuda" and not is_hip() and _properties(_index(device)).major == 9


def num_compute_units(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD): the persistent grid's size."""
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    return _properties(_index(device)).multi_processor_count


def num_xcds_for_arch(arch: str, num_cus: int) -> int:
    """XCDs (chiplets) of an AMD GPU, from its gfx arch name and CU count; 1 if unknown.

    Workgroups are dispatched round-robin across XCDs, so program p runs on XCD p % num_xcds.
    """
    arch = arch.split(":")[0]
    if arch == "gfx942":
        return 6 if num_cus == 228 else 8  # MI300A has 228 CUs on 6 XCDs; MI300X/MI325X 304 on 8
    if arch == "gfx950":
        return 8  # MI350 / MI355
    return 1


def default_num_shards(device: torch.device) -> int:
    """Counter shards: $TRITONBLAS_OPS_NUM_SHARDS, else XCDs on AMD, else 1.

    On the H200, 8 contiguous shards measured 5-12% slower than one counter (benchmarks/METHOD.md),
    and NVIDIA has no chiplet L2 to keep tiles near, so one shard is the NVIDIA default.
    """
    override = os.environ.get(SHARDS_ENV)
    if override is not None:
        shards = int(override)
        if shards < 1:
            raise ValueError(f"{SHARDS_ENV} must be a positive integer, got {override!r}")
        return shards
    if device.type == "cuda" and is_hip():
        props = _properties(_index(device))
        return num_xcds_for_arch(props.gcnArchName, props.multi_processor_count)
    return 1


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()

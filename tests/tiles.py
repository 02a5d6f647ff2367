"""A stand-in for select_config on the CPU, whose own choice is one fixed tile for every
shape: this one picks by M as the GPU's does (a transposed narrow tile for few rows, a K
split for some), so tests of batch invariance can fail there. Its small-M tiles also take
half the K step: a K split at whole steps, or a transposed product, may sum in the same
order as the large-M tile (in December 2026's CI environment they did), so the step is what
makes their bits differ. Batch-invariant configs sum K in chunks, as split-K units for
few rows (on a transposed tile for the fewest), inside each tile for more, and as a split
tail for many, as on the GPU.
chunk_ends: where a config's K chunks end, the order-defining fact that batch-invariant
configs share."""

import dataclasses

import pytest

from tritonblas_ops import launch, plan, settings
from tritonblas_ops.config import TileConfig


def m_dependent_selector(m, n, k, batches, dtype, device, *, allow_split_k=True, allow_swap_ab=True):
    if allow_swap_ab and m <= 4:
        return TileConfig(32, 16, 16, num_warps=4, num_stages=1, swap_ab=True)
    if allow_split_k and m <= 24:
        return TileConfig(16, 32, 16, num_warps=4, num_stages=1, split_k=2)
    return TileConfig(32, 32, 32, num_warps=4, num_stages=1)


def chunked_invariant_selector(m, n, k, batches, dtype, device, *, allow_split_k=True, allow_swap_ab=True,
                               warp_specialized=False):
    """Batch-invariant configs on the CPU with K in chunks, split-K units for few rows (as
    the GPU's cost model would pick; for the fewest the transposed problem's tile, as 16-bit
    decode takes on the GPU), summed inside each tile for more, and for more than 32 split
    tail (whole tiles summing in turn, the rest split into chunks; 16x16 tiles: more than
    the interpreter's 4 "SMs" for tens of rows)."""
    config = TileConfig(16, 16, 16, num_warps=4, num_stages=1, k_chunks=3)
    if allow_split_k and allow_swap_ab and m <= 4:
        return dataclasses.replace(config, split_k=3, swap_ab=True)
    if allow_split_k and (m <= 24 or m > 32):
        return dataclasses.replace(config, split_k=3, split_tail=m > 32)
    return config


def chunk_ends(config: TileConfig, k: int) -> tuple:
    """The K at which each of a config's chunks ends: chunks of whole K steps, none empty."""
    steps = -(-k // config.block_k)
    per_chunk = -(-steps // config.k_chunks)
    assert -(-steps // per_chunk) == config.k_chunks, (config, k)  # no empty chunk
    return tuple(min(k, c * per_chunk * config.block_k) for c in range(1, config.k_chunks + 1))


@pytest.fixture
def m_dependent_tiles(monkeypatch):
    """select_config replaced by m_dependent_selector, and batch-invariant configs by ones
    with K chunks split for few rows; the plan cache and settings restored."""
    monkeypatch.setattr(plan, "select_config", m_dependent_selector)
    monkeypatch.setattr(plan, "select_invariant_config", chunked_invariant_selector)
    launch.clear_plans()
    before = settings.current()
    yield
    settings.restore(before)
    launch.clear_plans()

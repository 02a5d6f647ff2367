"""Tile configs (tritonblas_ops/config.py): the cost model's choices on an H200's 132 SMs."""

import pytest
import torch

from tritonblas_ops import config as configs
from tritonblas_ops import device as devices
from tritonblas_ops.config import num_tiles, select_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_selector_splits_k_only_below_a_wave(dtype, monkeypatch):
    """The cost model (132 SMs, as the H200): shapes with a wave of tiles or more keep whole
    K; skinny and K-heavy ones are split, into slices no shorter than MIN_K_PER_SPLIT and no
    more than two waves of work units."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in [(8192, 8192, 8192), (4096, 14336, 4096), (3000, 5000, 2000), (1000, 1000, 1000)]:
        assert select_config(m, n, k, 1, dtype, gpu).split_k == 1, (m, n, k)
    for m, n, k in [(16, 4096, 4096), (1, 4096, 14336), (256, 512, 32768), (1024, 1024, 16384)]:
        config = select_config(m, n, k, 1, dtype, gpu)
        assert config.split_k > 1, (m, n, k)
        assert k // config.split_k >= configs.MIN_K_PER_SPLIT
        tiles = num_tiles(n, m, 1, config) if config.swap_ab else num_tiles(m, n, 1, config)
        assert tiles * config.split_k <= 2 * 132
        assert not select_config(m, n, k, 1, dtype, gpu, allow_split_k=False).split_k > 1
    assert select_config(16, 4096, 300, 1, dtype, gpu).split_k == 1  # K too short to split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_selector_swaps_operands_only_for_a_few_rows(dtype, monkeypatch):
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m in (1, 7, configs.SWAP_MAX_M):
        config = select_config(m, 14336, 4096, 1, dtype, gpu)
        assert config.swap_ab and config.block_n >= m, m
        assert not select_config(m, 14336, 4096, 1, dtype, gpu, allow_swap_ab=False).swap_ab
    assert not select_config(configs.SWAP_MAX_M + 1, 14336, 4096, 1, dtype, gpu).swap_ab
    assert not select_config(8, 8, 4096, 1, dtype, gpu).swap_ab  # N no wider than M


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_configs_fix_the_chunk_ends_per_n_and_k(dtype, monkeypatch):
    """Batch-invariant configs (132 SMs): for every M one K chunk count per (N, K), whose
    chunks end at the same K whatever the tile's K step, the tile following M (narrow with
    long K steps for decode, the big one for prefill). K is chunked only where even the
    narrowest decode tiles leave more than half the SMs idle; then decode launches split
    the chunks into units and prefill ones sum them in each tile, whose two fp32
    accumulators fit in registers (at most 64 values a thread each). Chunks hold whole K
    steps, none empty and none shorter than MIN_K_PER_SPLIT. No swap."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)

    def chunk_ends(config, k):
        steps = -(-k // config.block_k)
        per_chunk = -(-steps // config.k_chunks)
        assert -(-steps // per_chunk) == config.k_chunks  # no empty chunk
        return tuple(min(k, c * per_chunk * config.block_k) for c in range(1, config.k_chunks + 1))

    for n, k in [(1024, 1024), (512, 32768), (1000, 14336), (4096, 14336), (28672, 8192), (2000, 3000)]:
        by_m = {m: configs.select_invariant_config(m, n, k, 1, dtype, gpu) for m in (1, 16, 128, 1000, 4096, 8192)}
        assert len({chunk_ends(c, k) for c in by_m.values()}) == 1, (n, k)
        assert not any(c.swap_ab for c in by_m.values())
        chunks = by_m[1].k_chunks
        assert (chunks > 1) == (n < 2048), (n, k)
        if chunks > 1:
            assert by_m[1].split_k == chunks and by_m[8192].split_k == 1, (n, k)
            assert all(c.block_m * c.block_n // (c.num_warps * 32) <= 64 for c in by_m.values())
            assert k // chunks >= configs.MIN_K_PER_SPLIT
            assert configs.select_invariant_config(1, n, k, 1, dtype, gpu, allow_split_k=False).split_k == 1
        else:
            assert {c.split_k for c in by_m.values()} == {1}
        if n < 28672:  # with a wave of the widest tiles, decode takes them too
            assert by_m[1].block_n < by_m[8192].block_n, (n, k)

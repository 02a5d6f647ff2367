"""Tile configs (tritonblas_ops/config.py): the cost model's choices on an H200's 132 SMs."""

import pytest
import torch

from tritonblas_ops import config as configs
from tritonblas_ops import device as devices
from tritonblas_ops.config import num_tiles, select_config

from tiles import chunk_ends


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_config_selector_splits_k_only_below_a_wave(dtype, monkeypatch):
    """The cost model (132 SMs, as the H200): shapes with a wave of tiles or more keep whole
    K; skinny and K-heavy ones are split, into slices no shorter than MIN_K_PER_SPLIT and no
    more than two waves of work units."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in [(8192, 8192, 8192), (4096, 14336, 4096), (3000, 5000, 2000), (1000, 1000, 1000)]:
        assert select_config(m, n, k, 1, dtype, gpu).split_k == 1, (m, n, k)
    for m, n, k in [(16, 3072, 8192), (1, 4096, 14336), (256, 512, 32768), (1024, 1024, 16384)]:
        config = select_config(m, n, k, 1, dtype, gpu)
        assert config.split_k > 1, (m, n, k)
        assert k // config.split_k >= configs.MIN_K_PER_SPLIT
        tiles = num_tiles(n, m, 1, config) if config.swap_ab else num_tiles(m, n, 1, config)
        assert tiles * config.split_k <= 2 * 132
        assert not select_config(m, n, k, 1, dtype, gpu, allow_split_k=False).split_k > 1
    assert select_config(16, 4096, 300, 1, dtype, gpu).split_k == 1  # K too short to split


def test_config_selector_splits_a_tail_only_where_the_last_wave_is_mostly_idle(monkeypatch):
    """A split tail where a launch of a few waves would leave most of its last one idle (the
    mid-size weight gradients of the corpus's models group: 144 tiles of 128x128 on 132 SMs),
    its split tiles' slices within two waves; not for launches of many waves (the gain stays
    under TAIL_SPLIT_MIN_GAIN), of one wave or less (no whole tile), nor where the tail's
    slices are short and one wave of wider whole tiles does (K = 4096: 176 tiles of 128x128
    or 88 of 128x256, measured 0.70x of cuBLAS split, 0.78x whole; NOTES.md step 62)."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in [(1024, 2816, 4096), (2816, 1024, 4096)]:
        config = select_config(m, n, k, 1, torch.bfloat16, gpu)
        assert (config.block_m, config.block_n, config.split_k) == (128, 256, 1), (m, n, k)
    for m, n, k in [(3072, 768, 8192), (768, 3072, 8192), (2304, 1024, 8192)]:
        config = select_config(m, n, k, 1, torch.bfloat16, gpu)
        tiles = num_tiles(m, n, 1, config)
        assert config.split_tail and config.split_k > 1 and tiles > 132, (m, n, k)
        assert (tiles % 132) * config.split_k <= 2 * 132 and k // config.split_k >= configs.MIN_K_PER_SPLIT
    for m, n, k in [(8192, 8192, 8192), (4096, 14336, 4096), (8192, 1000, 14336), (1024, 1024, 16384),
                    (256, 512, 32768), (16, 4096, 4096)]:
        assert not select_config(m, n, k, 1, torch.bfloat16, gpu).split_tail, (m, n, k)
    assert not select_config(3072, 768, 8192, 1, torch.bfloat16, gpu, allow_split_k=False).split_tail


def test_batch_invariant_split_tails_split_the_chunks(monkeypatch):
    """Batch-invariant mode takes a split tail where normal mode would and K is chunked
    (3072x768x8192: 2 chunks, 144 tiles of 128x128 on 132 SMs): its slices are the chunks
    (split_k = k_chunks), so their ends are every other launch's of that (N, K). Without
    chunks (768x3072x8192) nothing may split K; a launch of many waves keeps whole tiles."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    tail = configs.select_invariant_config(3072, 768, 8192, 1, torch.bfloat16, gpu)
    decode = configs.select_invariant_config(1, 768, 8192, 1, torch.bfloat16, gpu)
    assert tail.split_tail and tail.split_k == tail.k_chunks == decode.k_chunks == 2
    assert chunk_ends(tail, 8192) == chunk_ends(decode, 8192)
    assert num_tiles(3072, 768, 1, tail) > 132
    assert not configs.select_invariant_config(3072, 768, 8192, 1, torch.bfloat16, gpu, allow_split_k=False).split_tail
    assert not configs.select_invariant_config(768, 3072, 8192, 1, torch.bfloat16, gpu).split_k > 1
    assert not configs.select_invariant_config(8192, 1000, 14336, 1, torch.bfloat16, gpu).split_tail


def test_config_selector_takes_the_measured_best_of_split_and_whole(monkeypatch):
    """The cost model's price of split-K partials, fitted to an H100's sweep (NOTES.md step
    62), picks the config that ran fastest there of those forced beside it: whole K on
    128x128 for 2048x1024x32768 (0.963x of cuBLAS; 128x256 split in 2: 0.944), 128x128 split
    in 2 for 128x8192x28672 (1.028; 128x256 split in 4: 1.000), and a split tail in 8 for
    2304x1024x8192 (0.753; 128x256 whole: 0.649)."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    measured_best = {(2048, 1024, 32768): (128, 128, 1, False), (128, 8192, 28672): (128, 128, 2, False),
                     (2304, 1024, 8192): (128, 128, 8, True)}
    for shape, best in measured_best.items():
        config = select_config(*shape, 1, torch.bfloat16, gpu)
        assert (config.block_m, config.block_n, config.split_k, config.split_tail) == best, shape


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


def test_decode_short_projections_take_the_narrow_swapped_tile(monkeypatch):
    """bf16 decode on 132 SMs, as measured on an H100 (NOTES.md steps 67 and 72): B^T of 1024
    rows (8B's key and value projections) in 64-row tiles of 5 stages, 8 K slices (1.07x of
    cuBLAS, against 0.88x for 16 slices of 128-row tiles); 4096 x 4096 in 64-row tiles of 8
    stages, whole K (0.97 and 1.10x for M = 1 and 16, against 0.91 and 1.02x for 128-row ones in
    4 slices); 3072 x 8192 and 4096 x 14336 keep 128-row tiles in 4 slices (the 8-stage tile
    whole within 2% of them), the wide ones 128-row tiles whole. The 8-stage tile never splits."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)

    def choice(m, n, k):
        config = select_config(m, n, k, 1, torch.bfloat16, gpu)
        assert config.swap_ab and not config.split_tail
        assert config.num_stages == 5 or config.split_k == 1
        return config.block_m, config.num_stages, config.split_k

    for m in (1, 16):
        assert choice(m, 1024, 4096) == (64, 5, 8)
        assert choice(m, 4096, 4096) == choice(m, 6144, 4096) == (64, 8, 1)
        assert choice(m, 3072, 8192) == choice(m, 4096, 14336) == (128, 5, 4)
        assert choice(m, 14336, 4096) == choice(m, 28672, 8192) == (128, 5, 1)


def test_batch_invariant_decode_takes_the_transposed_tile_where_it_fills_the_sms(monkeypatch):
    """16-bit batch-invariant decode on 132 SMs, as measured on an H100 (NOTES.md step 70):
    transposed tiles, K chunks as split-K units; 128 rows where their units fill half the
    SMs (14336- and 28672-wide weights), else 64 rows where theirs fill a quarter (3072- to
    8192-wide, N = 1000 with K = 14336 in 4 chunks); else the unswapped 32-column tile,
    twice the 64-row tile's count (1024 x 4096: 16 units). TF32 never swaps, nor a launch
    that may not (dynamic shapes), nor one of more than SWAP_MAX_M rows."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)

    def choice(m, n, k, dtype=torch.bfloat16, **kwargs):
        config = configs.select_invariant_config(m, n, k, 1, dtype, gpu, **kwargs)
        return config.swap_ab, config.block_m, config.split_k

    for m in (1, 16):
        for n, k in [(14336, 4096), (28672, 8192)]:
            assert choice(m, n, k) == (True, 128, 1), (m, n, k)
        for n, k in [(3072, 8192), (4096, 14336), (4096, 4096), (8192, 28672)]:
            assert choice(m, n, k) == (True, 64, 1), (m, n, k)
        assert choice(m, 1000, 14336) == (True, 64, 4)
        assert choice(m, 1024, 4096)[0] is False
        assert choice(m, 4096, 14336, torch.float16)[0] is True
        assert choice(m, 4096, 14336, torch.float32)[0] is False
        assert choice(m, 4096, 14336, allow_swap_ab=False)[0] is False
    assert choice(configs.SWAP_MAX_M + 1, 4096, 14336)[0] is False
    assert {configs.select_invariant_config(1, 4096, 14336, 1, torch.bfloat16, gpu).num_stages,
            configs.select_invariant_config(1, 14336, 4096, 1, torch.bfloat16, gpu).num_stages} == {8, 5}


# K chunks of every batch-invariant launch of an (N, K) on 132 SMs: 1 unless a decode
# launch's 32-column tiles fill fewer than 66 SMs and each streams more than 256 KB of B
# (bf16: K > 4096; fp32: K > 2048), then the fewest aligned chunks that fix either.
INVARIANT_CHUNKS = {
    torch.bfloat16: {(1024, 1024): 1, (2048, 2048): 1, (1000, 4096): 1, (2000, 3000): 1, (4096, 14336): 1,
                     (28672, 8192): 1, (1024, 16384): 4, (1000, 14336): 4, (512, 32768): 8},
    torch.float32: {(1024, 1024): 1, (2048, 2048): 1, (1000, 4096): 2, (2000, 3000): 3, (4096, 14336): 1,
                    (28672, 8192): 1, (1024, 16384): 4, (1000, 14336): 4, (512, 32768): 8},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_configs_fix_the_chunk_ends_per_n_and_k(dtype, monkeypatch):
    """Batch-invariant configs (132 SMs): for every M one K chunk count per (N, K), whose
    chunks end at the same K whatever the tile's K step or kernel, the tile following M
    (narrow with long K steps for decode, the big one for prefill). Chunked decode launches
    split the chunks into units and prefill ones sum them in each tile, whose two fp32
    accumulators fit in registers (at most 64 values a thread each). Chunks hold whole K
    steps, none empty and none shorter than MIN_K_PER_SPLIT. Only 16-bit decode swaps."""
    monkeypatch.setattr(devices, "num_compute_units", lambda device: 132)
    gpu = torch.device("cuda", 0)
    for (n, k), chunks in INVARIANT_CHUNKS[dtype].items():
        by_m = {(m, ws): configs.select_invariant_config(m, n, k, 1, dtype, gpu, warp_specialized=ws)
                for m in (1, 16, 128, 1000, 4096, 8192) for ws in (False, True)}
        assert {chunk_ends(c, k) for c in by_m.values()} == {chunk_ends(by_m[1, False], k)}, (n, k)
        assert by_m[1, False].k_chunks == chunks, (n, k)
        assert not any(c.swap_ab for (m, _), c in by_m.items() if m > configs.SWAP_MAX_M or dtype == torch.float32)
        if chunks > 1:
            assert by_m[1, False].split_k == chunks and by_m[8192, False].split_k == 1, (n, k)
            assert all(configs.fits_chunked(c) for c in by_m.values() if c.split_k == 1)
            assert k // chunks >= configs.MIN_K_PER_SPLIT
            assert configs.select_invariant_config(1, n, k, 1, dtype, gpu, allow_split_k=False).split_k == 1
        else:
            assert {c.split_k for c in by_m.values()} == {1}
        if n < 28672:  # with a wave of the widest tiles, decode takes them too
            assert by_m[1, False].block_n < by_m[8192, False].block_n, (n, k)

"""Tile configurations: chosen analytically from the shape, never autotuned on the hot path."""

import dataclasses

import torch
import triton

from tritonblas_ops import device as devices


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # output-tile rows per swizzle group, for L2 reuse of B's columns
    num_warps: int = 8
    num_stages: int = 3
    # K slices per output tile. Above 1 each slice is a work unit of its own; its fp32
    # partial goes to a workspace and the last slice to arrive sums them in slice order.
    split_k: int = 1
    # Split only the tail: the tiles of the launch's whole waves (on the device's SM count,
    # whatever the grid) are a unit each, whole K; only the last, partial wave's tiles are
    # split, so that their slices fill the SMs the whole tiles would leave idle (stream-K's
    # data-parallel + split-K tail).
    split_tail: bool = False
    # Solve C^T = B^T @ A^T instead (ws_matmul transposes the operands before the launch):
    # for M <= 16 the output's few rows become a narrow tile's columns, and the weight
    # streams through the wide side instead of filling a 64-row tile with padding.
    swap_ab: bool = False
    # Batch-invariant launches: K summed in this many chunks, each accumulated from zero
    # and then added up in chunk order. split_k is then 1 (the chunks run in turn inside a
    # tile) or k_chunks (each chunk a unit of its own): the same additions either way, so
    # whether a launch splits K (decided by M) cannot change a bit.
    k_chunks: int = 1
    # Throughput of one SM with this tile, relative to the best tile (select_config's model).
    efficiency: float = dataclasses.field(default=1.0, compare=False)
    # select_config never splits K on this tile (a measured loss where it would: see the tile).
    whole_k_only: bool = dataclasses.field(default=False, compare=False)

    @property
    def partial_bytes(self) -> int:
        """One split-K slice's fp32 partial of a tile."""
        return self.block_m * self.block_n * 4

    @property
    def sum_rows(self) -> int:
        """Rows of a tile one split-K sum unit adds up (work stealing)."""
        return self.block_m // sum_shares(self.block_m, self.split_k)


def sum_shares(block_m: int, split_k: int) -> int:
    """Sum units per split-K tile under work stealing: the tile's rows in as many
    power-of-two shares as fit in split_k (at least a row each), so there are about as many
    sums as slices."""
    return min(1 << (split_k.bit_length() - 1), block_m)


# The interpreter runs each tl op in numpy: bigger tiles mean fewer, cheaper Python steps.
INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1)

# 16-bit tiles, largest first, with their throughput measured on the H200 at 8192^3
# (benchmarks/NOTES.md, step 2: 670, 640 and 420 TFLOP/s). The small tile's 128-wide K
# steps halve its barriers per FLOP: 9-15% faster than 64-wide ones on 1024^3, 2048^3 and
# 256x512x32768 (NOTES.md step 12).
HALF_CONFIGS = (
    TileConfig(128, 256, 64, num_warps=8, num_stages=3, efficiency=1.0),
    TileConfig(128, 128, 64, num_warps=4, num_stages=4, efficiency=0.95),
    TileConfig(64, 128, 128, num_warps=4, num_stages=4, efficiency=0.63),
)
# TF32 tiles, with their throughput relative to the first on 4096^3 and 8192^3 (NOTES.md
# step 12: 128x256 beat 128x128 by 12-16%); the smallest one's is assumed. From Triton 3.9
# a TMA-stored C tile is staged in shared memory beside the pipeline's stages (3.6-3.8 reuse
# the drained stages): 128x256's 128 KB fp32 C then leaves no room for a pipeline on a
# Hopper SM (262-279 KB with 2-3 stages, compiled for sm_90), so TF32 starts at 128x128.
_C_STAGED_APART = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 9)
FP32_CONFIGS = (
    TileConfig(128, 256, 32, num_warps=8, num_stages=3, efficiency=1.0),
    TileConfig(128, 128, 32, num_warps=8, num_stages=4, efficiency=0.87),
    TileConfig(64, 128, 32, num_warps=4, num_stages=4, efficiency=0.57),
)[1 if _C_STAGED_APART else 0:]

# For M <= SWAP_MAX_M (decode-like GEMMs, bound by streaming B) the problem is solved
# transposed: B^T's N rows fill the tiles' 128 rows and M fits one 16-column tile; small
# tiles leave shared memory for deep pipelines of long K steps, keeping more of B in flight.
# The 64-row tile of 5 stages is for B^T's of ~2048 rows and fewer (decode's key and value
# projections): 8 slices of 16 tiles beat 16 of 128-row ones by 1.2x (half the partials a
# tile) on an H100, and run at 1.08x of cuBLAS on the H200; its efficiency is fitted so the
# model keeps 128 rows where they won (N = 3072-4096, NOTES.md steps 67 and 69). Decode's
# efficiencies follow the bytes of B a tile keeps in flight (stages x rows): 0.5 and, for
# the 64-row tile in 8 stages, 0.8. That one runs whole K only: a launch of one partial wave
# of whole tiles beat 128-row tiles in 2-4 slices by 1-8% (N = 3072-6144, an H100, step
# 72), but its own split units lost to the 5-stage ones (N = 1000, K = 14336 in 4: 0.97
# against 1.05x of cuBLAS) and to its whole K (N = 4096 in 2: 0.92 against 0.97x).
SWAP_MAX_M = 16
HALF_SWAPPED_CONFIGS = (
    TileConfig(128, 16, 128, num_warps=4, num_stages=5, swap_ab=True),
    TileConfig(64, 16, 128, num_warps=4, num_stages=5, swap_ab=True, efficiency=0.5),
    TileConfig(64, 16, 128, num_warps=4, num_stages=8, swap_ab=True, efficiency=0.8, whole_k_only=True),
)
FP32_SWAPPED_CONFIGS = (TileConfig(128, 16, 64, num_warps=4, num_stages=5, swap_ab=True),)

# Batch-invariant tiles. An output element's bits depend on how K is cut into chunks that
# are accumulated from zero, and on nothing else of the launch: wgmma adds one K step's
# products for an element alike whatever the tile's rows and columns, warps, stages or K
# step (a longer step is more of the same 16-wide instructions in a row; checked on the
# H200 and an H100 for bf16, fp16 and TF32: NOTES.md steps 24 and 33), and whichever operand
# it takes as A (an H100: steps 33 and 70). So the tile follows M: normal mode's tiles, and
# narrow ones that give small launches enough tiles; those take long K steps and deep
# pipelines, because a decode launch streams B and each SM needs ~50 KB of it in flight
# (64x32 tiles of 64-wide steps had 16 KB: decode at 0.40-0.80x of cuBLAS). Efficiencies of
# the narrow tiles are assumed, not measured. A tile that sums K chunks in turn (k_chunks >
# 1, split_k 1) holds a chunk's accumulator and the running total in registers: at most 64
# fp32 values a thread each, so 128x128 takes 8 warps and 128x256 runs chunks only as
# split-K units (one accumulator each).
HALF_INVARIANT_CONFIGS = HALF_CONFIGS + (
    TileConfig(128, 128, 64, num_warps=8, num_stages=4, efficiency=0.93),
    TileConfig(128, 64, 128, num_warps=4, num_stages=4, efficiency=0.75),
    TileConfig(64, 64, 128, num_warps=4, num_stages=6, efficiency=0.5),
    TileConfig(64, 32, 256, num_warps=4, num_stages=4, efficiency=0.3),
)
# 16-bit decode (M <= SWAP_MAX_M < N) solves the transposed problem, as normal mode does:
# B^T's rows fill 64- or 128-row tiles of 16 columns, whose 128-long K steps leave 128-160 KB
# of B in flight per SM; the unswapped 64x32 tile spends 2/3 of each stage on A's padding
# rows and had 64 KB (decode at 0.55-0.74x of cuBLAS on the H200, NOTES.md step 69). With
# the same K chunks, on an H100 (step 70): the 64-row tile in 8 stages ran the 3072- to
# 8192-wide weights at 0.96-1.08x, the unswapped one 0.59-0.90x; normal mode's 128-row tile
# beat it by 2-7% on the 14336- and 28672-wide ones, whose 64-row units run 1.7-3.4 waves.
# The first of these whose units (tiles times K chunks) fill its share of the SMs; with
# neither, the unswapped tiles, twice the 64-row tile's count (1024 wide: 16 transposed
# units ran 0.82x against 0.89x).
HALF_INVARIANT_DECODE_CONFIGS = (
    (HALF_SWAPPED_CONFIGS[0], 0.5),  # 128x16x128, 5 stages
    (TileConfig(64, 16, 128, num_warps=4, num_stages=8, swap_ab=True), 0.25),
)
FP32_INVARIANT_CONFIGS = FP32_CONFIGS + (
    TileConfig(128, 64, 64, num_warps=4, num_stages=4, efficiency=0.65),
    TileConfig(64, 64, 64, num_warps=4, num_stages=6, efficiency=0.45),
    TileConfig(64, 32, 128, num_warps=4, num_stages=4, efficiency=0.25),
)
MAX_CHUNKED_VALUES_PER_THREAD = 64
# A decode launch's narrowest tile streams its columns of B through one SM. Up to 256 KB a
# unit (~5 us at one SM's ~50 GB/s) decode needs no K chunks, however few SMs its tiles
# fill: chunks would cost every prefill launch of the (N, K) (NOTES.md step 48).
MAX_DECODE_UNIT_BYTES = 256 * 1024
# Each chunk after the first restarts the tile's pipeline: ~3-4 K steps of time each on the
# Triton kernel (H200, 128x128 on 8192^3 and 4096^3: 2 chunks cost 3-4%, 4 chunks 10-13%;
# NOTES.md step 24), ~1 on the warp-specialized kernel, whose loader runs on across the
# chunk's end (H100, 8192^3: 1713 us whole, 1720 / 1741 with 2 / 4 chunks; step 47).
CHUNK_RESTART_K_STEPS = 4
WARP_SPECIALIZED_CHUNK_RESTART_K_STEPS = 1

@dataclasses.dataclass(frozen=True)
class WarpSpecializedVariant:
    """How warp_specialized_kernel runs one tile: its shared-memory stages, C's subtiling and
    the partitions' sizes. Every choice here changes speed only, never a bit of C."""
    stages: int  # A and B stages in shared memory
    epilogue_n: int  # columns of a C subtile (its TMA store's box)
    c_bufs: int  # C subtile buffers: 2 lets a subtile's store overlap the next one's staging
    # With an (M, N) epilogue operand read ahead (a gate, a residual: plan.prefetch_bias) C's
    # buffers hold the whole tile, one per subtile, and the loader loads the operand's
    # subtiles into them during the K loop: the stages that then fit beside them.
    prefetch_stages: int
    tile_slots: int = 2  # tile ids the loader may claim ahead of the MMA warps
    claim_lead: int = 1  # K steps before a tile's last load that the next claim goes out
    loader_regs: int = 40  # registers per thread of the 1-warp loader partition
    # 8 MMA warps (2 warpgroups, a 16-row slab each per 128 rows) and the loader's warpgroup
    # resident together: 168 registers x 384 threads fit the SM's 64 K.
    num_warps: int = 8
    maxnreg: int = 168

    def kernel_constants(self) -> dict:
        return dict(STAGES=self.stages, C_BUFS=self.c_bufs, TILE_SLOTS=self.tile_slots,
                    CLAIM_LEAD=self.claim_lead, LOADER_REGS=self.loader_regs)

    @property
    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, maxnreg=self.maxnreg)

    def prefetching(self, block_n: int) -> "WarpSpecializedVariant":
        """The variant for launches that read their epilogue operand ahead into C's buffers."""
        return dataclasses.replace(self, stages=self.prefetch_stages, c_bufs=block_n // self.epilogue_n)


# The tiles (block_m, block_n, block_k) the warp-specialized kernel runs, those of
# HALF_CONFIGS it can take. 128x256: 4 stages fit beside two 128x64 C buffers, 3 beside
# the whole 64 KB tile (a prefetched epilogue operand); 128x128: 4 stages and the whole
# tile's buffer.
WARP_SPECIALIZED_TILES = {
    (128, 256, 64): WarpSpecializedVariant(stages=4, epilogue_n=64, c_bufs=2, prefetch_stages=3),
    (128, 128, 64): WarpSpecializedVariant(stages=4, epilogue_n=128, c_bufs=1, prefetch_stages=4),
}


SPLIT_K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_K_PER_SPLIT = 256  # shorter slices spend more on the pipeline's fill than on the dot
# What a byte of split-K partials costs in the model, in FLOPs of the best tile: 4x the
# H200's FLOP/byte ratio (~790 TFLOP/s over ~4 TB/s), fitted to an H100's sweep (NOTES.md
# step 62): the partial's write, its reread and the wait between them overlap nothing, and a
# split launch leaves the warp-specialized kernel. At 200, five shapes split K where a whole
# K ran 2-11% faster (1024x2816x4096 0.70x of cuBLAS split against 0.78x whole).
FLOPS_PER_BYTE = 800
FIXED_K_STEPS = 2  # per work unit: pipeline fill and epilogue, in K steps of the tile
# A sum unit reads its rows of every partial back at one SM's share of L2 (~150 GB/s
# against its ~6 TFLOP/s). Fitted to the sweep in NOTES.md step 9, where one program summed
# each whole tile (16 slices of 128x128 lost to 8 of 64x128 on 256x512x32768).
SLICE_SUM_FLOPS_PER_BYTE = 40
# A split tail is chosen only where the model has it this much faster than the best other
# choice: any K split moves a Hopper launch off the warp-specialized kernel, 2-15% faster
# than the Triton kernel where it runs (README), which the model does not see. A launch
# of a few waves whose last one is mostly idle gains far more (3072x768x8192 on 128x128
# tiles: 144 tiles, 2 waves' time for 1.09 waves' work).
TAIL_SPLIT_MIN_GAIN = 0.1


def num_tiles(m: int, n: int, batches: int, config: TileConfig) -> int:
    # Plain integer ceil-division: triton.cdiv is a jit function, ~4 us a host call.
    return -(-m // config.block_m) * -(-n // config.block_n) * batches


def _tail_splittable(tiles: int, split_k: int, units: int) -> bool:
    """Whether a split tail of `split_k` slices is a choice: whole waves before a partial
    last one, whose tiles' slices fill at most two waves."""
    return tiles > units and 0 < tiles % units and (tiles % units) * split_k <= 2 * units


def _tail_or_best(tail: TileConfig | None, tail_cost, best: TileConfig, best_cost) -> TileConfig:
    """The split tail where the model has it TAIL_SPLIT_MIN_GAIN ahead of the best other choice."""
    return tail if tail is not None and tail_cost < (1 - TAIL_SPLIT_MIN_GAIN) * best_cost else best


def _modeled_cost(m: int, n: int, k: int, batches: int, config: TileConfig, split_k: int,
                  units: int, split_tail: bool = False) -> float:
    """Time of the launch in FLOPs of one SM running the best tile: waves of work units, each
    unit its K slice (plus a fixed cost) at the tile's efficiency, and for split-K the
    partial each unit writes, then waves of sum units, each reading its rows of every
    partial (work stealing's sums, which all programs share). A split tail: the whole
    waves of whole tiles first, then the rest as split-K."""
    tiles = num_tiles(m, n, batches, config)

    def unit_cost(k_slice: int) -> float:
        return 2 * config.block_m * config.block_n * (k_slice + FIXED_K_STEPS * config.block_k) / config.efficiency

    whole_waves = tiles // units if split_tail else 0
    tiles -= whole_waves * units
    waves = -(-(tiles * split_k) // units)
    unit = unit_cost(-(-k // split_k))
    if split_k == 1:
        return waves * unit
    base = whole_waves * unit_cost(k)
    unit += config.partial_bytes * FLOPS_PER_BYTE
    shares = sum_shares(config.block_m, split_k)
    sum_waves = -(-(tiles * shares) // units)
    return (base + waves * unit
            + sum_waves * split_k * (config.partial_bytes // shares) * SLICE_SUM_FLOPS_PER_BYTE)


def select_config(m: int, n: int, k: int, batches: int, dtype: torch.dtype,
                  device: torch.device, *, allow_split_k: bool = True,
                  allow_swap_ab: bool = True) -> TileConfig:
    """The tile and K split that the cost model says finish first: bigger tiles are more
    efficient, but below a wave of tiles smaller ones (or K slices) keep more SMs busy.
    For M <= SWAP_MAX_M, the transposed problem's narrow tiles. The choice depends on the
    shape alone, so results are reproducible run to run."""
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    fp32 = dtype == torch.float32
    if allow_swap_ab and m <= SWAP_MAX_M < n:
        candidates = FP32_SWAPPED_CONFIGS if fp32 else HALF_SWAPPED_CONFIGS
        m, n = n, m
    else:
        candidates = FP32_CONFIGS if fp32 else HALF_CONFIGS
    units = devices.num_compute_units(device)
    best, best_cost = None, None
    tail, tail_cost = None, None  # the best split tail
    for config in candidates:
        tiles = num_tiles(m, n, batches, config)
        for split_k in SPLIT_K_CHOICES if allow_split_k and not config.whole_k_only else (1,):
            if split_k > 1 and k // split_k < MIN_K_PER_SPLIT:
                break
            if split_k == 1 or tiles * split_k <= 2 * units:
                cost = _modeled_cost(m, n, k, batches, config, split_k, units)
                if best_cost is None or cost < best_cost:
                    best, best_cost = dataclasses.replace(config, split_k=split_k), cost
            if split_k > 1 and _tail_splittable(tiles, split_k, units):
                cost = _modeled_cost(m, n, k, batches, config, split_k, units, split_tail=True)
                if tail_cost is None or cost < tail_cost:
                    tail, tail_cost = dataclasses.replace(config, split_k=split_k, split_tail=True), cost
    return _tail_or_best(tail, tail_cost, best, best_cost)


def k_chunk_choices(k: int, block_ks) -> list[int]:
    """Chunk counts for K that leave no chunk empty and none shorter than MIN_K_PER_SPLIT,
    and whose chunks end at the same K for every K step in `block_ks` (chunks hold whole K
    steps, as split-K slices do: ceil(steps / chunks) each)."""
    def chunk_end(chunks: int, block_k: int) -> int | None:
        steps = -(-k // block_k)
        per_chunk = -(-steps // chunks)
        return per_chunk * block_k if -(-steps // per_chunk) == chunks else None

    def aligned(chunks: int) -> bool:
        ends = {chunk_end(chunks, block_k) for block_k in block_ks}
        return len(ends) == 1 and None not in ends

    return [c for c in SPLIT_K_CHOICES if c == 1 or (k // c >= MIN_K_PER_SPLIT and aligned(c))]


def fits_chunked(config: TileConfig, num_warps: int | None = None) -> bool:
    """Whether a tile's two fp32 accumulators (a chunk's and the running total) fit in
    registers, over the config's warps or (the warp-specialized kernel's) num_warps."""
    threads = (num_warps or config.num_warps) * 32
    return config.block_m * config.block_n // threads <= MAX_CHUNKED_VALUES_PER_THREAD


def _invariant_choice(m: int, n: int, k: int, batches: int, chunks: int, candidates, units: int,
                      allow_split_k: bool, warp_specialized: bool) -> TileConfig:
    """The modeled fastest config for K in `chunks` chunks: the chunks summed in turn in
    each tile (where its two accumulators fit) or (allow_split_k) each a split-K unit, or a
    split tail of them (whole tiles summing the chunks in turn, then the last wave's tiles
    split into their chunks), taken as select_config takes a tail."""
    best, best_cost = None, None
    tail, tail_cost = None, None
    for config in candidates:
        restart_steps = (WARP_SPECIALIZED_CHUNK_RESTART_K_STEPS
                         if warp_specialized and (config.block_m, config.block_n, config.block_k)
                         in WARP_SPECIALIZED_TILES else CHUNK_RESTART_K_STEPS)
        restarts = (chunks - 1) * restart_steps * config.block_k
        tiles = num_tiles(m, n, batches, config)
        in_turn = chunks == 1 or fits_chunked(config)
        if in_turn:
            cost = _modeled_cost(m, n, k + restarts, batches, config, 1, units)
            if best_cost is None or cost < best_cost:
                best, best_cost = dataclasses.replace(config, k_chunks=chunks), cost
        if not allow_split_k or chunks == 1:
            continue
        if tiles * chunks <= 2 * units:
            cost = _modeled_cost(m, n, k, batches, config, chunks, units)
            if best_cost is None or cost < best_cost:
                best, best_cost = dataclasses.replace(config, split_k=chunks, k_chunks=chunks), cost
        # A tail's whole tiles sum the chunks in turn on the Triton kernel (split launches run
        # there); its slices restart nothing, but the model has one K: the whole tiles'.
        if in_turn and _tail_splittable(tiles, chunks, units):
            whole_k = k + (chunks - 1) * CHUNK_RESTART_K_STEPS * config.block_k
            cost = _modeled_cost(m, n, whole_k, batches, config, chunks, units, split_tail=True)
            if tail_cost is None or cost < tail_cost:
                tail = dataclasses.replace(config, split_k=chunks, k_chunks=chunks, split_tail=True)
                tail_cost = cost
    return _tail_or_best(tail, tail_cost, best, best_cost)


def invariant_k_chunks(n: int, k: int, element_size: int, candidates, units: int, decode_candidates=()) -> int:
    """The K chunk count of every batch-invariant launch of an (N, K) on `units` SMs: 1
    unless a decode launch's narrowest candidate tiles would fill fewer than half the SMs
    and each stream more than MAX_DECODE_UNIT_BYTES of B; then the fewest chunks that fix
    either (their ends the same for every candidate's and decode candidate's K step).
    Counted over the unswapped tiles, as measured (NOTES.md step 48): the transposed decode
    tiles keep as much of B in flight with the same chunks (step 70)."""
    narrowest = min(config.block_n for config in candidates)
    decode_tiles = -(-n // narrowest)
    unit_bytes = narrowest * k * element_size
    choices = k_chunk_choices(k, {config.block_k for config in candidates + decode_candidates})
    fixed = (c for c in choices if 2 * decode_tiles * c >= units or unit_bytes <= c * MAX_DECODE_UNIT_BYTES)
    return next(fixed, choices[-1])


def select_invariant_config(m: int, n: int, k: int, batches: int, dtype: torch.dtype, device: torch.device,
                            *, allow_split_k: bool = True, allow_swap_ab: bool = True,
                            warp_specialized: bool = False) -> TileConfig:
    """Batch-invariant launches: each output element summed in an order set by (N, K) alone,
    whatever M and the batch count: K in invariant_k_chunks chunks. Then the tile, and
    whether the chunks are split-K units, follow this launch's M: 16-bit decode on the
    first transposed tile of HALF_INVARIANT_DECODE_CONFIGS whose units fill its share of the
    SMs (allow_swap_ab), the chunks its units; otherwise by the cost model (warp_specialized:
    the launch may run on the warp-specialized kernel, whose chunks restart cheaper; it
    changes the tile, never the chunks)."""
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    fp32 = dtype == torch.float32
    candidates = FP32_INVARIANT_CONFIGS if fp32 else HALF_INVARIANT_CONFIGS
    decode_configs = () if fp32 else HALF_INVARIANT_DECODE_CONFIGS
    units = devices.num_compute_units(device)
    chunks = invariant_k_chunks(n, k, dtype.itemsize, candidates, units,
                                tuple(config for config, _ in decode_configs))
    if allow_swap_ab and m <= SWAP_MAX_M < n:
        for config, min_fill in decode_configs:
            decode = dataclasses.replace(config, k_chunks=chunks, split_k=chunks if allow_split_k else 1)
            if num_tiles(n, m, batches, decode) * decode.split_k >= min_fill * units:
                return decode
    return _invariant_choice(m, n, k, batches, chunks, candidates, units, allow_split_k, warp_specialized)

"""The work-stealing persistent GEMM, warp-specialized for Hopper (sm_90), in Gluon:
C[b] = act(alpha * A[b] @ B[b] + beta * bias), bf16/fp16 in, fp32 accumulation.

The same product as kernel.ws_matmul_kernel's, bit for bit, for the launches it takes
(plan.Kernel.WARP_SPECIALIZED: not traced, host tensor descriptors, no K split):
the same tiles, swizzle, claim counters and claim rules (scheduler.WorkQueue), the same
K order of wgmma steps and the same epilogue arithmetic (kernel._epilogue itself).

Why a second kernel: the Triton kernel runs each tile's pipeline fill, next claim and
epilogue back to back, with the tensor cores idle in between. Here a 1-warp loader
partition claims tiles and keeps a ring of shared-memory stages full, so the next tile's
first K steps are resident while the MMA warps (the default partition, 2 warpgroups on one
128-row tile) run the current tile's epilogue.

Partitions and their handshakes (mbarriers, one CTA):
  loader (1 warp)                           MMA warps (default partition, 8 warps)
  claim the first tile (atomic)             wait tile_ready[slot]; read the id; arrive tile_empty
  per tile: wait tile_empty[slot];          per K step: wait ready[s]; async wgmma; wgmma_wait(1);
    write the id; arrive tile_ready            bar.sync; arrive empty[previous s]
  per K step: wait empty[s]; expect bytes;  epilogue per EPI_N-column subtile: bias, activation,
    TMA A and B -> ready[s]                    regs -> smem, TMA store left in flight
  claim the next tile CLAIM_LEAD steps      then the next tile id
    before the tile's last load
  with an (M, N) bias read ahead:           at K step 2 of every tile but the first: wait for
    wait bias_free; TMA the tile's bias        the previous tile's stores; arrive bias_free;
    subtiles into C's buffers -> bias_ready    before the epilogue wait bias_ready
  tile id -1 ends both; the loader adds its tiles to the tally (checked launches).

Operands are (batch, rows, cols) host descriptors with a box of one batch, as kernel.py's;
a column-major A and a K-major B are described as their transposes and read by wgmma
transposed from shared memory. C is row-major, stored through C_BUFS (BLOCK_M, EPI_N)
buffers. A bias that is a whole (M, N) operand (a gate, a residual, a pre-activation)
otherwise costs the epilogue a global load per subtile, in the accumulator's layout and
after the K loop; read ahead, C's buffers hold the whole tile and receive it by TMA while
the K loop runs (one stage fewer fits beside them on 128x256 tiles).

With offs (grouped GEMMs along K, grouped.py: the MoE weight gradient) batch g is group g,
whose K range offs gives: the loader starts the tile's boxes at the group's begin in A's and
B's descriptors and publishes its K length with its id, and the MMA warps zero what the
group's last partial box reads past its end.

With K_CHUNKS > 1 (batch-invariant launches) the MMA warps cut each tile's K steps into
K_CHUNKS chunks as kernel._tile_product does, each accumulated from zero and added to a
running total in order; the loader streams on across the chunks' ends, so a chunk costs one
wgmma drain instead of the Triton kernel's pipeline restart.

Reads top to bottom: claims, the groups, the loader, the tile-id ring, the epilogue, the
MMA partition, the kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Plain @triton.jit helpers that Gluon calls as they are (the claims, scalar code run by the
# loader warp, and the epilogue's elementwise math on any layout): kernel.py's own rules
# and rounding.
from tritonblas_ops.kernel import _claim_unit, _epilogue, _leaving, _tile_coords

# A barrier over the calling partition's warps (bar.sync on the partition's named barrier):
# gl.thread_barrier in Triton 3.6, gl.barrier from 3.8.
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# TMA copies: async_copy_global_to_shared / async_copy_shared_to_global in Triton 3.6,
# async_load / async_store from 3.8 (3.9 removed the old names); same arguments.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

# scheduler.STATUS_BAD_OFFSETS (grouped_kernel.py's), for a malformed offs along K.
_BAD_OFFSETS: gl.constexpr = gl.constexpr(4)

# ---------------------------------------------------------------------------------------
# The tile-id ring: the loader publishes each claimed tile, the MMA warps take it
# ---------------------------------------------------------------------------------------


@gluon.jit
def _publish_tile(tile, k_len, count, tile_ids, tile_ready, tile_empty, TILE_SLOTS: gl.constexpr):
    """Loader side: wait for the slot to be free, write the id and the tile's K length (a
    group's, along a ragged K), signal."""
    slot = count % TILE_SLOTS
    # Fresh mbarriers count as having completed the phase before phase 0: waiting on
    # phase ^ 1 lets the first TILE_SLOTS publications through.
    mbarrier.wait(tile_empty.index(slot), ((count // TILE_SLOTS) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pair = gl.arange(0, 2, layout=layout)
    tile_ids.index(slot).store(gl.where(pair == 0, tile, k_len))
    # The arrive releases the store above to whoever waits on tile_ready.
    mbarrier.arrive(tile_ready.index(slot))
    return count + 1


@gluon.jit
def _next_tile(count, tile_ids, tile_ready, tile_empty, TILE_SLOTS: gl.constexpr):
    """MMA side: the next tile id (-1: done) and its K length, its slot handed back."""
    slot = count % TILE_SLOTS
    mbarrier.wait(tile_ready.index(slot), (count // TILE_SLOTS) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pair = tile_ids.index(slot).load(layout)
    first = gl.arange(0, 2, layout=layout) == 0
    tile = gl.sum(gl.where(first, pair, 0), axis=0)
    k_len = gl.sum(gl.where(first, 0, pair), axis=0)
    # Every warp has read the slot before the loader may overwrite it (the arrive is one
    # thread's).
    _partition_barrier()
    mbarrier.arrive(tile_empty.index(slot))
    return tile, k_len, count + 1


# ---------------------------------------------------------------------------------------
# Groups along K (grouped GEMMs' weight gradients)
# ---------------------------------------------------------------------------------------


@gluon.jit
def _max2(x, y):
    return gl.maximum(x, y)


@gluon.jit
def _group_k_ranges(offs_ptr, num_groups, K, status_ptr, pid, GROUPS_BLOCK: gl.constexpr):
    """Each group's [begin, end) along K from offs (their ends), as vectors over
    GROUPS_BLOCK > num_groups slots, clamped and made non-decreasing as the grouped Triton
    kernel's (grouped_kernel._groups) are; a malformed offs sets the status bit."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    idx = gl.arange(0, GROUPS_BLOCK, layout=layout)
    ends = gl.load(offs_ptr + idx, mask=idx < num_groups, other=K)
    begins = gl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx <= num_groups), other=0)
    begins = gl.where(idx > num_groups, K, begins)
    bad = (idx < num_groups) & ((ends < begins) | (ends < 0) | (ends > K))
    if (gl.max(bad.to(gl.int32), axis=0) > 0) & (pid == 0):
        gl.atomic_or(status_ptr, _BAD_OFFSETS, sem="relaxed")
    ends = gl.associative_scan(gl.minimum(gl.maximum(ends, 0), K), 0, _max2)
    begins = gl.associative_scan(gl.minimum(gl.maximum(begins, 0), K), 0, _max2)
    return idx, begins, ends


@gluon.jit
def _zero_k_past(stage, valid, K_AXIS: gl.constexpr):
    """Zeros the entries of a landed (1, rows, cols) stage whose K index, along K_AXIS (1:
    rows, 2: columns), is `valid` or more: the next group's, which a box along a ragged K
    reads past its group's end."""
    ROWS: gl.constexpr = stage.shape[1]
    COLS: gl.constexpr = stage.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    view = stage.reshape([ROWS, COLS])
    values = view.load(layout)
    if K_AXIS == 1:
        k = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1)
    else:
        k = gl.expand_dims(gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)), 0)
    view.store(gl.where(k < valid, values, gl.zeros_like(values)))


# ---------------------------------------------------------------------------------------
# The loader partition
# ---------------------------------------------------------------------------------------


@gluon.jit
def _load_partition(a_desc, b_desc, bias_desc, a_bufs, b_bufs, c_bufs, ready, empty, tile_ids, tile_ready,
                    tile_empty, bias_ready, bias_free, counters_ptr, budget_ptr, unit_counts_ptr, offs_ptr,
                    M, N, K, num_batches,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, NUM_SHARDS: gl.constexpr, COUNTER_STRIDE: gl.constexpr,
                    CHECKED: gl.constexpr, A_ROW_MAJOR: gl.constexpr, B_ROW_MAJOR: gl.constexpr,
                    TILE_SLOTS: gl.constexpr, CLAIM_LEAD: gl.constexpr, GROUPS_BLOCK: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n * num_batches
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    home_shard = pid % NUM_SHARDS
    # The counters' layout (scheduler.WorkQueue): a claim counter per shard, then the tally
    # line (tiles done, status bits).
    tally_ptr = counters_ptr + NUM_SHARDS * COUNTER_STRIDE
    status_ptr = tally_ptr + 1
    if offs_ptr is not None:  # ragged K: batch g is group g, the K range offs gives it
        group_idx, group_begins, group_ends = _group_k_ranges(offs_ptr, num_batches, K, status_ptr, pid,
                                                              GROUPS_BLOCK)

    # (dry_shards a tensor from the start: a loop-carried value may not change type)
    tile, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, gl.to_tensor(0), num_tiles,
                                   num_programs, _leaving(budget_ptr, pid), budget_ptr, NUM_SHARDS,
                                   COUNTER_STRIDE)
    tiles_done = 0
    tile_count = 0
    load_count = 0  # K steps issued so far, over all tiles: the stage ring's position
    while tile >= 0:
        if unit_counts_ptr is not None:
            gl.atomic_add(unit_counts_ptr + tile, 1, sem="relaxed")
        batch, tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        k_first = 0
        k_len = K
        operand_batch = batch
        if offs_ptr is not None:  # 2-D A and B, the group a K range of theirs
            k_first = gl.sum(gl.where(group_idx == batch, group_begins, 0), axis=0)
            k_len = gl.sum(gl.where(group_idx == batch, group_ends, 0), axis=0) - k_first
            operand_batch = 0
        tile_count = _publish_tile(tile, k_len, tile_count, tile_ids, tile_ready, tile_empty, TILE_SLOTS)
        k_steps = gl.cdiv(k_len, BLOCK_K)
        # The next tile is claimed CLAIM_LEAD K steps before this tile's last load, before
        # that step's wait for a free stage: the atomic's round trip overlaps the waits, and
        # the claim stays late enough to leave the other programs their share at the end.
        # A program leaving under a live budget loads the tile it holds, then goes.
        claim_step = gl.maximum(k_steps - 1 - CLAIM_LEAD, 0)
        next_tile = tile
        if offs_ptr is not None:
            if k_steps == 0:  # an empty group: its tile is zeros, and the next claim is now
                next_tile, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_tiles,
                                                    num_programs, _leaving(budget_ptr, pid), budget_ptr,
                                                    NUM_SHARDS, COUNTER_STRIDE)
        for ks in range(k_steps):
            if ks == claim_step:
                next_tile, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_tiles,
                                                    num_programs, _leaving(budget_ptr, pid), budget_ptr,
                                                    NUM_SHARDS, COUNTER_STRIDE)
            s = load_count % STAGES
            mbarrier.wait(empty.index(s), ((load_count // STAGES) & 1) ^ 1)  # the MMA warps are done with s
            bar = ready.index(s)
            mbarrier.expect(bar, STAGE_BYTES)  # TMA counts the whole box, clipped or not
            k0 = k_first + ks * BLOCK_K
            if A_ROW_MAJOR:
                _tma_load(a_desc, [operand_batch, m0, k0], bar, a_bufs.index(s))
            else:
                _tma_load(a_desc, [operand_batch, k0, m0], bar, a_bufs.index(s))
            if B_ROW_MAJOR:
                _tma_load(b_desc, [operand_batch, k0, n0], bar, b_bufs.index(s))
            else:
                _tma_load(b_desc, [operand_batch, n0, k0], bar, b_bufs.index(s))
            load_count += 1
        if bias_desc is not None:
            # The tile's epilogue operand into C's buffers, one box per subtile, once the
            # MMA warps have seen the previous tile's stores out of them (a few K steps into
            # this tile, which are loaded by now): it lands during this tile's last steps.
            SUBTILES: gl.constexpr = c_bufs.type.shape[0]
            EPI_N: gl.constexpr = bias_desc.block_type.shape[2]
            mbarrier.wait(bias_free, (tiles_done & 1) ^ 1)
            mbarrier.expect(bias_ready, SUBTILES * bias_desc.block_type.nbytes)
            for j in gl.static_range(SUBTILES):
                _tma_load(bias_desc, [0, m0, n0 + j * EPI_N], bias_ready, c_bufs.index(j))
        tiles_done += 1
        tile = next_tile
    _publish_tile(-1, 0, tile_count, tile_ids, tile_ready, tile_empty, TILE_SLOTS)
    if CHECKED:
        # Every tile published is computed: the MMA warps take every id before the -1.
        gl.atomic_add(tally_ptr, tiles_done, sem="relaxed")


# ---------------------------------------------------------------------------------------
# The epilogue and the MMA partition
# ---------------------------------------------------------------------------------------


@gluon.jit
def _store_c(acc, c_desc, c_bufs, bias_desc, bias_ptr, batch, m0, n0, M, N, stride_bias_m, stride_bias_n,
             alpha, beta, ACTIVATION: gl.constexpr, GATE: gl.constexpr, SUBTILE: gl.constexpr):
    """C[batch, m0:, n0:] = act(alpha * acc + beta * bias) (or, under GATE, act(bias) *
    alpha * acc) in C's dtype: kernel._store_tile's fp32 operations in its order, so the
    same bits. Stored as EPI_N-wide subtiles, left to right, through the ring of C_BUFS
    shared buffers; SUBTILE: the first subtile's number in the tile. With a bias_desc the
    bias subtile is already in the subtile's own buffer (the loader's prefetch), read from
    there and overwritten by C; else it is read from global memory here. Halves acc
    (recursively: its width is constexpr) until it is one subtile wide: the wgmma layout
    holds column bits 3 and up in registers, so a halving only renames registers."""
    EPI_N: gl.constexpr = c_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    if WIDTH == EPI_N:
        layout: gl.constexpr = acc.type.layout
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = n0 + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, layout))
        C_BUFS: gl.constexpr = c_bufs.shape[0]
        buf = c_bufs.index(SUBTILE % C_BUFS)
        bias = None
        if bias_ptr is not None:
            if bias_desc is not None:
                bias = buf.reshape([BLOCK_M, EPI_N]).load(layout)  # zeros past M and N, as TMA clips
                _partition_barrier()  # every warp has its bias before C overwrites the buffer
            else:
                in_tile = (offs_m < M)[:, None] & (offs_n < N)[None, :]
                bias = gl.load(bias_ptr + offs_m[:, None] * stride_bias_m + offs_n[None, :] * stride_bias_n,
                               mask=in_tile, other=0.0)
        c = _epilogue(acc, bias, alpha, beta, ACTIVATION, GATE).to(c_desc.dtype)
        if bias_desc is None:
            # Round robin: the C_BUFS - 1 newest stores read the other buffers, so with at
            # most that many in flight the last store from this buffer is done reading it.
            # Subtile 0's wait is for the previous tile's stores, which ran during this
            # tile's K loop. (Prefetching: every subtile has its buffer, and the previous
            # tile's stores were waited for before the prefetch.)
            tma.store_wait(C_BUFS - 1)
            _partition_barrier()
        buf.reshape([BLOCK_M, EPI_N]).store(c)
        fence_async_shared()  # the generic proxy's smem writes, visible to the TMA unit
        _partition_barrier()
        _tma_store(c_desc, [batch, m0, n0], buf)  # clipped at M, N
    else:
        # (BLOCK_M, WIDTH) -> (BLOCK_M, WIDTH / 2, 2): the last axis is the column's top
        # bit, which splits the left half from the right.
        halves = gl.permute(gl.reshape(acc, [BLOCK_M, 2, WIDTH // 2]), [0, 2, 1])
        left, right = gl.split(halves)
        _store_c(left, c_desc, c_bufs, bias_desc, bias_ptr, batch, m0, n0, M, N, stride_bias_m, stride_bias_n,
                 alpha, beta, ACTIVATION, GATE, SUBTILE)
        _store_c(right, c_desc, c_bufs, bias_desc, bias_ptr, batch, m0, n0 + WIDTH // 2, M, N, stride_bias_m,
                 stride_bias_n, alpha, beta, ACTIVATION, GATE, SUBTILE + WIDTH // 2 // EPI_N)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, c_bufs, c_desc, bias_desc, ready, empty, tile_ids, tile_ready, tile_empty,
                   bias_ready, bias_free, bias_ptr, offs_ptr, M, N, K, stride_bias_m, stride_bias_n,
                   alpha, beta,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, A_ROW_MAJOR: gl.constexpr, B_ROW_MAJOR: gl.constexpr,
                   ACTIVATION: gl.constexpr, GATE: gl.constexpr, TILE_SLOTS: gl.constexpr,
                   C_BUFS: gl.constexpr, K_CHUNKS: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    EPI_N: gl.constexpr = c_desc.block_type.shape[2]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # The wgmma accumulator: warpgroups stacked along M (8 warps for 128 rows), one
    # m64nBLOCK_Nk16 instruction per warpgroup and K slice, as Triton's tl.dot issues them.
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS, "one 16-row slab per warp: BLOCK_M = 16 * num_warps")
    gl.static_assert(BLOCK_N % EPI_N == 0 and (BLOCK_N // EPI_N) % C_BUFS == 0,
                     "whole subtiles, and a whole number of C buffer rounds per tile")
    gl.static_assert(bias_desc is None or BLOCK_N // EPI_N == C_BUFS,
                     "a prefetched bias needs a C buffer per subtile")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    # The K step of each tile after the first at which the previous tile's stores are
    # waited for and C's buffers handed to the loader's prefetch: late enough for the
    # stores to have drained, early enough for the prefetch to land before the epilogue.
    free_step = gl.minimum(2, gl.cdiv(K, BLOCK_K) - 1)

    tile, k_len, tile_count = _next_tile(0, tile_ids, tile_ready, tile_empty, TILE_SLOTS)
    mma_count = 0  # K steps consumed so far, over all tiles (the loader's load_count)
    tiles_done = 0
    while tile >= 0:
        batch, tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        k_steps = gl.cdiv(k_len, BLOCK_K)
        if K_CHUNKS > 1:
            total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            chunk_steps = gl.cdiv(k_steps, K_CHUNKS)  # kernel._tile_product's chunk length
        for ks in range(k_steps):
            s = mma_count % STAGES
            mbarrier.wait(ready.index(s), (mma_count // STAGES) & 1)
            if K_CHUNKS > 1:
                if (ks > 0) & (ks % chunk_steps == 0):  # a chunk's first step: the last one's sum is done
                    total += warpgroup_mma_wait(0, deps=(acc, ))
                    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            if offs_ptr is not None:
                k_valid = k_len - ks * BLOCK_K
                if k_valid < BLOCK_K:  # the group's last, partial step: the next group's K past it
                    _zero_k_past(a_bufs.index(s), k_valid, 2 if A_ROW_MAJOR else 1)
                    _zero_k_past(b_bufs.index(s), k_valid, 1 if B_ROW_MAJOR else 2)
                    fence_async_shared()  # the generic proxy's zeros, visible to wgmma
                    _partition_barrier()
            # The stages hold one batch's box: seen as 2-D, transposed back where the
            # descriptor describes the operand as its transpose.
            if A_ROW_MAJOR:
                a = a_bufs.index(s).reshape([BLOCK_M, BLOCK_K])
            else:
                a = a_bufs.index(s).reshape([BLOCK_K, BLOCK_M]).permute((1, 0))
            if B_ROW_MAJOR:
                b = b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
            else:
                b = b_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # One wgmma in flight: this wait retires the previous step's, whose stage goes
            # back to the loader. wgmma_wait is per warpgroup, so all warps meet before the
            # (one-thread) arrive.
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _partition_barrier()
            mbarrier.arrive(empty.index((mma_count + STAGES - 1) % STAGES), pred=ks > 0)
            if bias_desc is not None:
                if (ks == free_step) & (tiles_done > 0):
                    tma.store_wait(0)
                    _partition_barrier()
                    mbarrier.arrive(bias_free)
            mma_count += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if K_CHUNKS > 1:
            acc = total + acc
        _partition_barrier()
        mbarrier.arrive(empty.index((mma_count + STAGES - 1) % STAGES), pred=k_steps > 0)
        # The epilogue, while the loader fills the stages with the next tile's first steps.
        if bias_desc is not None:
            mbarrier.wait(bias_ready, tiles_done & 1)
        _store_c(acc, c_desc, c_bufs, bias_desc, bias_ptr, batch, tile_m * BLOCK_M, tile_n * BLOCK_N, M, N,
                 stride_bias_m, stride_bias_n, alpha, beta, ACTIVATION, GATE, 0)
        tiles_done += 1
        # The next tile id last: the loader has had the whole epilogue to claim it.
        tile, k_len, tile_count = _next_tile(tile_count, tile_ids, tile_ready, tile_empty, TILE_SLOTS)
    tma.store_wait(0)


# ---------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------


@gluon.jit
def warp_specialized_matmul_kernel(
    a_desc,  # (B, M, K) with box (1, BLOCK_M, BLOCK_K); column-major: (B, K, M), box transposed
    b_desc,  # (B, K, N) with box (1, BLOCK_K, BLOCK_N); K-major: (B, N, K), box transposed
    c_desc,  # (B, M, N) row-major, box (1, BLOCK_M, EPI_N)
    bias_desc,  # the bias as (1, M, N) row-major with C's box, read ahead into C's buffers; or None
    bias_ptr,  # (M, N) view (broadcast strides may be 0), or None
    counters_ptr,  # int32, WorkQueue.numel of them: zero at launch and left at zero
    budget_ptr,  # int32 (1,): a live budget (programs at or above it leave between tiles), or None
    unit_counts_ptr,  # int32 (tiles,) zeroed, or None: +1 per tile claimed (tests; stores checked by value)
    offs_ptr,  # int32 (num_batches,): the groups' ends along a ragged K (2-D A and B), or None
    M, N, K, num_batches,  # a grouped launch: K the groups' summed, num_batches the groups
    stride_bias_m, stride_bias_n,
    alpha, beta,  # fp32
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_SHARDS: gl.constexpr, COUNTER_STRIDE: gl.constexpr,
    CHECKED: gl.constexpr,  # tally the tiles done, for the host to compare (checked launches)
    A_ROW_MAJOR: gl.constexpr, B_ROW_MAJOR: gl.constexpr,
    ACTIVATION: gl.constexpr,  # of the epilogue (kernel._activation's names)
    GATE: gl.constexpr,  # the bias is a gate: act(gate) * product
    STAGES: gl.constexpr,  # shared-memory stages of A and B
    C_BUFS: gl.constexpr,  # shared buffers of C's (BLOCK_M, EPI_N) subtiles
    TILE_SLOTS: gl.constexpr,  # tile ids the loader may publish ahead of the MMA warps
    CLAIM_LEAD: gl.constexpr,  # K steps before a tile's last load that the next claim goes out
    LOADER_REGS: gl.constexpr,  # registers per thread of the loader warp
    GROUPS_BLOCK: gl.constexpr,  # a power of two above the group count (ragged K)
    K_CHUNKS: gl.constexpr,  # chunks of each tile's K summed in turn (batch-invariant), or 1
):
    gl.static_assert(K_CHUNKS == 1 or offs_ptr is None, "K chunks of a plain GEMM only")
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_ids = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # id, K
    tile_ready = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [C_BUFS] + c_desc.block_type.shape, c_desc.layout)
    bias_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # prefetch landed
    bias_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # C's buffers drained
    mbarrier.init(bias_ready, count=1)
    mbarrier.init(bias_free, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect; the TMA bytes complete it
        mbarrier.init(empty.index(i), count=1)  # one arrive from the MMA warps
    for i in gl.static_range(TILE_SLOTS):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=1)
    fence_async_shared()  # the barriers' inits visible to the TMA unit before its first copy

    # The argument tuples are written out in the call: a tuple assigned to a variable first
    # would turn its constexprs into tensors.
    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, c_bufs, c_desc, bias_desc, ready, empty, tile_ids, tile_ready,
                          tile_empty, bias_ready, bias_free, bias_ptr, offs_ptr, M, N, K, stride_bias_m,
                          stride_bias_n, alpha, beta,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_ROW_MAJOR, B_ROW_MAJOR, ACTIVATION, GATE,
                          TILE_SLOTS, C_BUFS, K_CHUNKS)),
        (_load_partition, (a_desc, b_desc, bias_desc, a_bufs, b_bufs, c_bufs, ready, empty, tile_ids,
                           tile_ready, tile_empty, bias_ready, bias_free, counters_ptr, budget_ptr,
                           unit_counts_ptr, offs_ptr, M, N, K, num_batches,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SHARDS, COUNTER_STRIDE, CHECKED,
                           A_ROW_MAJOR, B_ROW_MAJOR, TILE_SLOTS, CLAIM_LEAD, GROUPS_BLOCK)),
    ], [1], [LOADER_REGS])

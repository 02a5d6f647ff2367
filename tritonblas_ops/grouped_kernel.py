"""The grouped persistent loop, device code: mixture-of-experts GEMMs (torch._grouped_mm),
every group's tiles in one work-stealing queue, over kernel.py's tile body and claim code.

Each program reads `offs` (the groups' ends along the ragged dimension) and counts the
groups' tiles itself, the same count in every program, so the queue's rules (scheduler.py:
every unit once, counters left at zero) hold as for a GEMM, with no host sync. Reads top to
bottom: the groups from offs, then the loop.
"""

import triton
import triton.language as tl

from tritonblas_ops.kernel import (
    _claim_unit, _leaving, _program_descriptor, _store_tile, _tile_coords, _tile_product,
)

# Patched by Triton while an interpreted launch runs (kernel.py says why).
_TL_CORE = tl.core

# scheduler.STATUS_BAD_OFFSETS: this module holds device code only.
_BAD_OFFSETS: tl.constexpr = tl.constexpr(4)


@triton.jit
def _max(x, y):
    return tl.maximum(x, y)


@triton.jit
def _groups(offs_ptr, num_groups, extent, GROUPS_BLOCK: tl.constexpr):
    """Each group's [begin, end) along the ragged dimension, from offs (its groups' ends), as
    vectors over GROUPS_BLOCK > num_groups slots: groups 0..G-1, the tail [offs[G-1],
    extent) as group G (no group's: written as zeros), then empty ones. Also whether offs
    was malformed (an end outside [0, extent], or below the one before): its ends are then
    clamped and made non-decreasing, so the groups stay disjoint and inside the operands."""
    idx = tl.arange(0, GROUPS_BLOCK)
    ends = tl.load(offs_ptr + idx, mask=idx < num_groups, other=extent)
    begins = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx <= num_groups), other=0)
    begins = tl.where(idx > num_groups, extent, begins)
    bad = (idx < num_groups) & ((ends < begins) | (ends < 0) | (ends > extent))
    # begins is ends shifted by one, so the same clamp and running max keep it so.
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), extent), 0, _max)
    begins = tl.associative_scan(tl.minimum(tl.maximum(begins, 0), extent), 0, _max)
    return begins, ends, tl.max(bad.to(tl.int32)) > 0


@triton.jit
def _pick(values, index, GROUPS_BLOCK: tl.constexpr):
    """values[index] of a vector over groups, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, GROUPS_BLOCK) == index, values, 0))


@triton.jit
def ws_grouped_kernel(
    a_ptr, b_ptr, c_ptr,  # as RAGGED says (below); a 2-D operand has batch stride 0
    offs_ptr,  # int32 (num_groups,): the groups' ends along the ragged dimension
    counters_ptr,  # int32, zero at launch and left at zero (scheduler.WorkQueue, split_k 1)
    unit_counts_ptr,  # int32 zeroed, or None: +1 per unit done (tests)
    budget_ptr,  # int32 (1,): a live budget, or None
    a_desc, b_desc,  # A's and B's tensor descriptors under USE_TMA (built on the host), or
    # None along K, where each unit makes its group's
    M, N, K, num_groups,  # M, N, K: whole extents (the ragged one summed over its groups)
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SHARDS: tl.constexpr, COUNTER_STRIDE: tl.constexpr,
    CHECKED: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    # Which dimension offs splits: "m": A (M, K) of every group's rows, B (G, K, N), C (M, N)
    # (the MoE forward); "n": A (G, M, K), B (K, N), C (M, N); "k": A (M, K), B (K, N),
    # C (G, M, N) (the weight gradient).
    RAGGED: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr,  # a power of two above num_groups
):
    """C = A @ B per group, every group's tiles in one work-stealing queue, sized on the GPU
    from offs (no host sync): along a ragged M or N a group's rows (columns) make whole tile
    rows (columns) of their own, "slots", numbered group after group; along K each group is
    one batch of tiles with its own K range. The tile body is the GEMM's, with the group's
    end passed as the M (N) edge; rows past it are read (another group's) but not stored."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tally_ptr = counters_ptr + NUM_SHARDS * COUNTER_STRIDE
    status_ptr = tally_ptr + 1
    if RAGGED == "m":
        begins, ends, bad = _groups(offs_ptr, num_groups, M, GROUPS_BLOCK)
        slots = tl.cdiv(ends - begins, BLOCK_M)
    elif RAGGED == "n":
        begins, ends, bad = _groups(offs_ptr, num_groups, N, GROUPS_BLOCK)
        slots = tl.cdiv(ends - begins, BLOCK_N)
    else:
        tl.static_assert(RAGGED == "k", "RAGGED is m, n or k")
        begins, ends, bad = _groups(offs_ptr, num_groups, K, GROUPS_BLOCK)
        slots = tl.zeros((GROUPS_BLOCK,), tl.int32)
    if bad & (pid == 0):
        tl.atomic_or(status_ptr, _BAD_OFFSETS, sem="relaxed")
    slot_ends = tl.cumsum(slots, 0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_batches = 1
    if RAGGED == "m":
        tiles_m = tl.sum(slots)
    elif RAGGED == "n":
        tiles_n = tl.sum(slots)
    else:
        num_batches = num_groups
    num_units = tiles_m * tiles_n * num_batches
    units_done = 0

    home_shard = pid % NUM_SHARDS
    dry_shards = 0
    leaving = _leaving(budget_ptr, pid)
    unit, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_units,
                                   num_programs, leaving, budget_ptr, NUM_SHARDS, COUNTER_STRIDE)
    while unit >= 0:
        batch, tile_m, tile_n = _tile_coords(unit, tiles_m, tiles_n, GROUP_M)
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        m_end = M
        n_end = N
        k_begin = 0
        k_end = K
        a_batch = batch  # a 2-D operand's batch stride is 0 (batch is 0 but along K)
        b_batch = batch
        unit_a_desc = a_desc
        unit_b_desc = b_desc
        if RAGGED == "k":
            k_begin = _pick(begins, batch, GROUPS_BLOCK)
            k_end = _pick(ends, batch, GROUPS_BLOCK)
            if USE_TMA:
                # Descriptors of the group's K range alone, whose edge the copy engine clips
                # (one covering all of K would sum the next group's rows into this one).
                # The host takes this path only where K is no operand's unit stride, so the
                # shifted bases stay 16-byte aligned.
                k_len = tl.maximum(k_end - k_begin, 1)
                k_shift = k_begin.to(tl.int64)  # x^T of 65536 x 8 tokens by 7168 passes 2**31
                unit_a_desc = _program_descriptor(a_ptr + k_shift * stride_ak, 1, M, k_len, 0, stride_am,
                                                  stride_ak, BLOCK_M, BLOCK_K, A_ROW_MAJOR)
                unit_b_desc = _program_descriptor(b_ptr + k_shift * stride_bk, 1, k_len, N, 0, stride_bk,
                                                  stride_bn, BLOCK_K, BLOCK_N, B_ROW_MAJOR)
                k_end -= k_begin
                k_begin = 0
                a_batch = batch * 0
                b_batch = batch * 0
        else:
            slot = tile_m if RAGGED == "m" else tile_n
            group = tl.sum((slot_ends <= slot).to(tl.int32))
            group_slots = _pick(slots, group, GROUPS_BLOCK)
            first = (_pick(begins, group, GROUPS_BLOCK)
                     + (slot - _pick(slot_ends, group, GROUPS_BLOCK) + group_slots)
                     * (BLOCK_M if RAGGED == "m" else BLOCK_N))
            end = _pick(ends, group, GROUPS_BLOCK)
            k_end = tl.where(group < num_groups, K, 0)  # the tail: no product, zeros
            expert = tl.minimum(group, num_groups - 1)
            if RAGGED == "m":
                m0 = first
                m_end = end
                b_batch = expert
            else:
                n0 = first
                n_end = end
                a_batch = expert
        acc = _tile_product(
            a_ptr, b_ptr, unit_a_desc, unit_b_desc, a_batch, b_batch, m0, n0, k_begin, k_end, 1, m_end, n_end,
            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, 1, INPUT_PRECISION, INT64_INDEX,
            USE_TMA, A_ROW_MAJOR, B_ROW_MAJOR,
        )
        leaving = _leaving(budget_ptr, pid)
        next_unit, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_units,
                                            num_programs, leaving, budget_ptr, NUM_SHARDS, COUNTER_STRIDE)
        # Pointer stores: a tile's box would write past its group's end into the next one's.
        _store_tile(
            acc, c_ptr, None, None, batch, m0, n0, m_end, n_end,
            stride_cb, stride_cm, stride_cn, 0, 0, 1.0, 0.0,
            BLOCK_M, BLOCK_N, INT64_INDEX, False, "none", False,
        )
        if unit_counts_ptr is not None:
            tl.atomic_add(unit_counts_ptr + unit, 1, sem="relaxed")
        units_done += 1
        unit = next_unit

    if CHECKED:
        tl.atomic_add(tally_ptr, units_done, sem="relaxed")

"""The work-stealing persistent GEMM, device code: C[b] = alpha * A[b] @ B[b] + beta * bias.

One program per SM/CU. The work units (every batch's output tiles, in one queue, and with
split-K each tile's K slices) are numbered 0..U-1 in GROUP_M-swizzled tile order and split
into NUM_SHARDS contiguous shards, each with an atomic counter. Program p starts on shard
p % NUM_SHARDS (on AMD that is its XCD, so its tiles stay in that XCD's L2), claims units
there until the shard is dry, then steals from the other shards in order. Every unit is
computed exactly once, by whichever program claims it, for any grid size and however many
programs actually run (other kernels may hold SMs), and under a live budget (a device word
read between units, budget.LiveBudget) programs may leave mid-launch while the others
finish their work. The counters' layout and rules are scheduler.WorkQueue's; a launch's
every decision is plan.LaunchPlan's.

Each unit runs its K range in one program, in a fixed order. With split-K each slice stores
an fp32 partial (with a split tail only the tiles from `whole_tiles` on are split, the
units before them whole tiles); under work stealing the partials are summed by sum units
(a few rows of a tile each) claimed after every product unit, under the static schedule by
the tile's last slice to arrive, always in slice order. Results are bitwise reproducible whatever the
schedule. No wait is unbounded: a sum that waits too long for its slices gives up, writes
NaN and flags the launch's status (scheduler.STATUS_*).

Reads top to bottom: work-unit helpers, the tile body (descriptors, product, split-K sum,
epilogue), the persistent loop. grouped_kernel.py runs the same tile body and claims over
mixture-of-experts groups.
"""

import triton
import triton.language as tl

# While an interpreted launch runs (interpreter.py), Triton patches the triton.language
# modules it finds among these globals; its own helpers (tl.cdiv, ...) are written against
# tl.core, so that must be one of them.
_TL_CORE = tl.core

# The status bits below are scheduler.STATUS_*: this module holds device code only.
_CLAIM_OUT_OF_RANGE: tl.constexpr = tl.constexpr(1)
_WAIT_TIMED_OUT: tl.constexpr = tl.constexpr(2)

# ---------------------------------------------------------------------------------------
# Work-unit helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of a tile number, GROUP_M rows swizzled together
    so that programs running at the same time share B's columns in L2."""
    tiles_per_batch = tiles_m * tiles_n
    batch = tile // tiles_per_batch
    tile_in_batch = tile % tiles_per_batch
    tiles_per_group = GROUP_M * tiles_n
    first_m = (tile_in_batch // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile_in_batch % tiles_per_group) % group_rows
    tile_n = (tile_in_batch % tiles_per_group) // group_rows
    return batch, tile_m, tile_n


@triton.jit
def _shard_begin(shard, num_units, NUM_SHARDS: tl.constexpr):
    """First work unit of a shard: shards are contiguous, their sizes differ by at most one."""
    return (shard.to(tl.int64) * num_units // NUM_SHARDS).to(tl.int32)


@triton.jit
def _leaving(budget_ptr, pid):
    """Whether this program leaves now: under a live budget (a device word the host lowers
    while GEMMs run, budget.LiveBudget), programs at or above it finish the unit they hold
    and go; the others take over their work. Never without one."""
    if budget_ptr is not None:
        return pid >= tl.load(budget_ptr, volatile=True)
    else:
        return False


@triton.jit
def _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_units, num_programs, leaving,
                budget_ptr, NUM_SHARDS: tl.constexpr, COUNTER_STRIDE: tl.constexpr):
    """The next work unit for this program, or -1 once every shard is dry or it is leaving.

    `dry_shards` counts the shards, from the home shard on, that this program is done with;
    it is carried between calls so no program asks an empty shard twice. Every program ends
    its business with every shard by exactly one terminal op: a claim that finds it dry, or,
    for a program leaving under a live budget, a departure. So the last terminal op a shard
    ever gets is its (num_programs)th, and its program resets the counter for the next
    launch; a larger count means the counter was not zero at launch (scheduler.py).

    Without a live budget a shard's counter is an int32 of claims. With one it is the int64
    at the start of the shard's line: claims in the low half, departures in the high half,
    so that one atomic sees both counts.
    """
    unit = -1
    while (unit < 0) & (dry_shards < NUM_SHARDS):
        shard = (home_shard + dry_shards) % NUM_SHARDS
        begin = _shard_begin(shard, num_units, NUM_SHARDS)
        size = _shard_begin(shard + 1, num_units, NUM_SHARDS) - begin
        counter = counters_ptr + shard * COUNTER_STRIDE
        # Relaxed is enough: the counter only hands out indices, it guards no data.
        if budget_ptr is not None:
            counter = counter.to(tl.pointer_type(tl.int64))
            step = tl.where(leaving, 1 << 32, 1).to(tl.int64)
            before = tl.atomic_add(counter, step, sem="relaxed")
            claimed = (before & 0xFFFFFFFF).to(tl.int32)
            departed = (before >> 32).to(tl.int32)
            takes = (claimed < size) & (leaving == 0)
        else:
            claimed = tl.atomic_add(counter, 1, sem="relaxed")
            departed = 0
            takes = claimed < size
        if takes:
            unit = begin + claimed
        else:
            # Terminal ops before this one: the claims that found the shard dry, departures.
            terminal = tl.maximum(claimed - size, 0) + departed
            if terminal == num_programs - 1:
                if budget_ptr is not None:
                    tl.store(counter, tl.cast(0, tl.int64))  # (a layout-free zero: Gluon calls this too)
                else:
                    tl.store(counter, 0)
            if terminal >= num_programs:
                tl.atomic_or(status_ptr, _CLAIM_OUT_OF_RANGE, sem="relaxed")
            dry_shards += 1
    return unit, dry_shards


# ---------------------------------------------------------------------------------------
# The tile body: the product over a K range, split-K partial sums, the epilogue
# ---------------------------------------------------------------------------------------


@triton.jit
def _program_descriptor(ptr, num_batches, rows, cols, stride_batch, stride_row, stride_col,
                        BOX_ROWS: tl.constexpr, BOX_COLS: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """A (batch, rows, cols) operand's tensor descriptor, made by a program when the host
    built none (traced launches), as _descriptor builds it on the host: a box of (1 batch,
    rows, columns), so one descriptor serves every tile of every batch; a column-major
    operand is described as its transpose (and transposed back in registers)."""
    # In 64 bits: the unused batch stride of one long operand (a group of 2**18 tokens along
    # K, by 8192) passes 2**31.
    stride_batch = tl.cast(stride_batch, tl.int64)
    if ROW_MAJOR:
        if num_batches == 1:  # unused, but every stride must be a 16-byte multiple
            stride_batch = tl.cast(stride_row, tl.int64) * rows
        desc = tl.make_tensor_descriptor(ptr, [num_batches, rows, cols], [stride_batch, stride_row, 1],
                                         [1, BOX_ROWS, BOX_COLS])
    else:
        if num_batches == 1:
            stride_batch = tl.cast(stride_col, tl.int64) * cols
        desc = tl.make_tensor_descriptor(ptr, [num_batches, cols, rows], [stride_batch, stride_col, 1],
                                         [1, BOX_COLS, BOX_ROWS])
    return desc


@triton.jit
def _tile_product(
    a_ptr, b_ptr, a_desc, b_desc, a_batch, b_batch, m0, n0, k_begin, k_end, chunks,
    M, N,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
):
    """The fp32 product of A[a_batch]'s rows [m0, m0 + BLOCK_M) and B[b_batch]'s columns
[n0, n0 + BLOCK_N) over K in [k_begin, k_end), in a fixed order: one output tile's.

    K_CHUNKS > 1 (batch-invariant launches): the range in `chunks` chunks of whole K steps
    (K_CHUNKS, or 1 for a split tail's slice, a chunk already), each accumulated from zero
    and added to a total in order, exactly as split-K's partials of those chunks are summed,
    so splitting K or not gives the same bits. Each chunk is a loop of its own: a chunk's end
    tested inside one loop keeps Triton from pipelining the MMAs (NOTES.md step 24).
    """
    if K_CHUNKS == 1:
        return _k_range_product(
            a_ptr, b_ptr, a_desc, b_desc, a_batch, b_batch, m0, n0, k_begin, k_end, M, N,
            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INT64_INDEX, USE_TMA, A_ROW_MAJOR, B_ROW_MAJOR,
        )
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_chunk = tl.cdiv(tl.cdiv(k_end - k_begin, BLOCK_K), chunks) * BLOCK_K
    for chunk in range(chunks):
        # A chunk past K's end (planning leaves none) adds a zero, as split-K's empty slice.
        chunk_begin = k_begin + chunk * k_per_chunk
        total += _k_range_product(
            a_ptr, b_ptr, a_desc, b_desc, a_batch, b_batch, m0, n0, chunk_begin,
            tl.minimum(k_end, chunk_begin + k_per_chunk), M, N,
            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INT64_INDEX, USE_TMA, A_ROW_MAJOR, B_ROW_MAJOR,
        )
    return total


@triton.jit
def _k_range_product(
    a_ptr, b_ptr, a_desc, b_desc, a_batch, b_batch, m0, n0, k_begin, k_end, M, N,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
):
    """A tile's fp32 product over K in [k_begin, k_end), accumulated from zero in K order.
    Edges are exact: rows and columns past M, N, k_end are read as zeros (no index wrapping).
    (A grouped launch passes a group's end as M or N: rows past it are another group's.)

    USE_TMA: operands move through the program's tensor descriptors (Hopper's copy engine),
    which clip the edges in hardware; K slices end on multiples of BLOCK_K, so only the last
    one meets the edge at K. Otherwise through masked pointer loads, for any strides.
    """
    if not USE_TMA:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        if INT64_INDEX:  # some element offset reaches 2**31: do the address math in int64
            a_batch = a_batch.to(tl.int64)
            b_batch = b_batch.to(tl.int64)
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
            offs_k = offs_k.to(tl.int64)
        in_m = offs_m < M
        in_n = offs_n < N
        a_ptrs = a_ptr + a_batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + b_batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if USE_TMA:
            if A_ROW_MAJOR:
                a = a_desc.load([a_batch, m0, k0]).reshape(BLOCK_M, BLOCK_K)
            else:
                a = a_desc.load([a_batch, k0, m0]).reshape(BLOCK_K, BLOCK_M).T
            if B_ROW_MAJOR:
                b = b_desc.load([b_batch, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                b = b_desc.load([b_batch, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            in_k = offs_k < k_end
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            offs_k += BLOCK_K
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _store_partial(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K: store this slice's fp32 partial and count its arrival. Returns how many of
    the tile's slices had arrived before this one."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offs, acc)
    # Every thread's part of the partial is written before one thread counts the arrival;
    # the arrival releases the partials, and whoever sums them acquires them first.
    tl.debug_barrier()
    return tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")


@triton.jit
def _slice_sum(partials_ptr, tile, row0, SPLIT_K: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [row0, row0 + ROWS) of a tile's split-K partials, summed in slice order: bitwise
    the same whoever sums them, in whatever row shares."""
    offs = (row0 + tl.arange(0, ROWS))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        # .cg: read from L2, where the other SMs' writes are, never from a stale L1.
        acc += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    return acc


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """The epilogue's activation of fp32 x, as torch defines it: "none", "relu", "gelu"
    (erf), "gelu_tanh" (tanh(z) as 1 - 2 / (exp(2z) + 1): Triton has no tanh of its own,
    and this form saturates cleanly at both ends), "silu"; or, as a gate, the slope of one
    (activations.SLOPES, as torch's backward computes it)."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    elif ACTIVATION == "d_gelu":
        x = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == "d_gelu_tanh":
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        x = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACTIVATION == "d_silu":
        s = tl.sigmoid(x)
        x = s * (1.0 + x * (1.0 - s))
    else:
        tl.static_assert(ACTIVATION == "none", "unknown activation")
    return x


@triton.jit
def _epilogue(acc, bias, alpha, beta, ACTIVATION: tl.constexpr, GATE: tl.constexpr):
    """act(alpha * acc + beta * bias), or under GATE act(bias) * alpha * acc, in fp32 (bias
    None: none): every kernel's epilogue arithmetic, in one order, so they round alike."""
    acc = acc * alpha
    if bias is not None:
        if GATE:
            acc = acc * _activation(bias.to(tl.float32), ACTIVATION)
        else:
            acc += beta * bias.to(tl.float32)
    if not GATE:
        acc = _activation(acc, ACTIVATION)
    return acc


@triton.jit
def _store_tile(
    acc, c_ptr, c_desc, bias_ptr, batch, m0, n0, M, N,
    stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
    alpha, beta,
    ROWS: tl.constexpr, COLS: tl.constexpr, INT64_INDEX: tl.constexpr,
    TMA_STORE: tl.constexpr, ACTIVATION: tl.constexpr, GATE: tl.constexpr,
):
    """C[m0:m0 + ROWS, n0:n0 + COLS] = act(alpha * acc + beta * bias), or under GATE
    act(bias) * alpha * acc (a gated linear unit's product: the bias is the gate), rounded to
    C's dtype; nothing past M, N written (the program's C descriptor, whose box is the whole
    tile, clips the edges; masked stores otherwise)."""
    offs_m = m0 + tl.arange(0, ROWS)
    offs_n = n0 + tl.arange(0, COLS)
    if INT64_INDEX:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    in_m = offs_m < M
    in_n = offs_n < N
    bias = None
    if bias_ptr is not None:
        bias_ptrs = bias_ptr + offs_m[:, None] * stride_bias_m + offs_n[None, :] * stride_bias_n
        bias = tl.load(bias_ptrs, mask=in_m[:, None] & in_n[None, :], other=0.0)
    acc = _epilogue(acc, bias, alpha, beta, ACTIVATION, GATE)
    c = acc.to(c_ptr.dtype.element_ty)
    if TMA_STORE:  # descriptor coordinates stay int32; the descriptor addresses in 64 bits
        c_desc.store([batch, m0, n0], c.reshape(1, ROWS, COLS))
    else:
        if INT64_INDEX:
            batch = batch.to(tl.int64)
        c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, c, mask=in_m[:, None] & in_n[None, :])


# ---------------------------------------------------------------------------------------
# The persistent loop
# ---------------------------------------------------------------------------------------


@triton.jit
def ws_matmul_kernel(
    a_ptr,  # (B, M, K), any strides
    b_ptr,  # (B, K, N), any strides
    c_ptr,  # (B, M, N), written
    bias_ptr,  # (M, N) view (broadcast strides may be 0), or None
    counters_ptr,  # int32, WorkQueue.numel of them: zero at launch and left at zero
    partials_ptr,  # fp32 (split tiles * SPLIT_K * BLOCK_M * BLOCK_N,) workspace, or None (SPLIT_K 1)
    unit_counts_ptr,  # int32 (product units,) zeroed, or None: +1 per product unit done (tests)
    budget_ptr,  # int32 (1,): a live budget (programs at or above it leave between units), or None
    # Under USE_TMA, A's and B's tensor descriptors built on the host (eager launches), or
    # None: each program makes them (traced launches, which have no data pointers yet).
    a_desc, b_desc,
    c_desc,  # C's likewise, under TMA_STORE
    M, N, K, num_batches,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_bias_m, stride_bias_n,
    alpha, beta,  # fp32 (eager), or fp64 where Inductor types Python floats so: rounded below
    max_spins,  # polls of an arrival counter before a split-K sum gives up
    whole_tiles,  # with SPLIT_K > 1, the tiles before this one are not split (a split tail)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    K_CHUNKS: tl.constexpr,  # chunks of a whole tile's K summed in turn (batch-invariant), or 1
    SUM_ROWS: tl.constexpr,
    NUM_SHARDS: tl.constexpr, COUNTER_STRIDE: tl.constexpr,
    WORK_STEALING: tl.constexpr,
    CHECKED: tl.constexpr,  # tally the units done, for the host to compare (checked launches)
    INPUT_PRECISION: tl.constexpr, INT64_INDEX: tl.constexpr,
    USE_TMA: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    TMA_STORE: tl.constexpr,
    ACTIVATION: tl.constexpr,  # of the epilogue: "none", "relu", "gelu", "gelu_tanh", "silu"
    GATE: tl.constexpr,  # the bias is a gate: act(gate) * product (SwiGLU's, GeGLU's)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n * num_batches
    # Work units: the whole tiles, then each split tile's K slices, numbered next to each
    # other (claimed close in time).
    if SPLIT_K == 1:
        num_units = num_tiles
    else:
        num_units = whole_tiles + (num_tiles - whole_tiles) * SPLIT_K
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
    # The counters' layout (scheduler.WorkQueue): a claim counter per shard, the tally line
    # (units done, status), the split-K sums' claim counter, an arrival count per tile.
    tally_ptr = counters_ptr + NUM_SHARDS * COUNTER_STRIDE
    status_ptr = tally_ptr + 1
    sums_counter_ptr = tally_ptr + COUNTER_STRIDE
    arrivals_ptr = sums_counter_ptr + COUNTER_STRIDE
    units_done = 0

    if USE_TMA:
        if a_desc is None:
            a_desc = _program_descriptor(a_ptr, num_batches, M, K, stride_ab, stride_am, stride_ak,
                                         BLOCK_M, BLOCK_K, A_ROW_MAJOR)
            b_desc = _program_descriptor(b_ptr, num_batches, K, N, stride_bb, stride_bk, stride_bn,
                                         BLOCK_K, BLOCK_N, B_ROW_MAJOR)
    if TMA_STORE:  # row-major C
        if c_desc is None:
            c_desc = _program_descriptor(c_ptr, num_batches, M, N, stride_cb, stride_cm, stride_cn,
                                         BLOCK_M, BLOCK_N, True)

    home_shard = pid % NUM_SHARDS
    dry_shards = 0
    if WORK_STEALING:
        leaving = _leaving(budget_ptr, pid)
        unit, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_units,
                                       num_programs, leaving, budget_ptr, NUM_SHARDS, COUNTER_STRIDE)
    else:
        unit = tl.where(pid < num_units, pid, -1)

    while unit >= 0:
        if SPLIT_K == 1:
            tile = unit
            k_begin = 0
            k_end = K
            chunks = K_CHUNKS
        else:
            sliced = unit >= whole_tiles
            slice_unit = tl.maximum(unit - whole_tiles, 0)
            tile = tl.where(sliced, whole_tiles + slice_unit // SPLIT_K, unit)
            split = slice_unit % SPLIT_K
            k_begin = tl.where(sliced, split * k_per_split, 0)
            k_end = tl.where(sliced, tl.minimum(K, k_begin + k_per_split), K)
            # K_CHUNKS > 1 only with a split tail, whose slices are its chunks (plan.py)
            chunks = tl.where(sliced, 1, K_CHUNKS)
        batch, tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        acc = _tile_product(
            a_ptr, b_ptr, a_desc, b_desc, batch, batch, m0, n0, k_begin, k_end, chunks, M, N,
            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNKS, INPUT_PRECISION, INT64_INDEX,
            USE_TMA, A_ROW_MAJOR, B_ROW_MAJOR,
        )
        # The next unit is claimed before this one's epilogue, which hides the atomic's
        # round trip and holds the claim no longer than the epilogue lasts.
        if WORK_STEALING:
            leaving = _leaving(budget_ptr, pid)
            next_unit, dry_shards = _claim_unit(counters_ptr, status_ptr, home_shard, dry_shards, num_units,
                                                num_programs, leaving, budget_ptr, NUM_SHARDS, COUNTER_STRIDE)
        else:
            next_unit = unit + num_programs
            next_unit = tl.where(next_unit < num_units, next_unit, -1)
        if SPLIT_K == 1:
            tile_done = True
        else:
            tile_done = unit < whole_tiles
            if sliced:  # partials and arrivals are the split tiles' only
                split_tile = tile - whole_tiles
                if WORK_STEALING:  # sum units add the partials up (after this loop)
                    _store_partial(acc, partials_ptr, arrivals_ptr, split_tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
                else:
                    arrived = _store_partial(acc, partials_ptr, arrivals_ptr, split_tile, split, SPLIT_K,
                                             BLOCK_M, BLOCK_N)
                    tile_done = arrived == SPLIT_K - 1
                    if tile_done:  # static: the tile's last slice to arrive sums it by itself
                        acc = _slice_sum(partials_ptr, split_tile, 0, SPLIT_K, BLOCK_M, BLOCK_M, BLOCK_N)
                        tl.store(arrivals_ptr + split_tile, 0)  # the counter is clean for the next launch
        if tile_done:
            _store_tile(
                acc, c_ptr, c_desc, bias_ptr, batch, m0, n0, M, N,
                stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
                alpha, beta, BLOCK_M, BLOCK_N, INT64_INDEX, TMA_STORE, ACTIVATION, GATE,
            )
        if unit_counts_ptr is not None:
            tl.atomic_add(unit_counts_ptr + unit, 1, sem="relaxed")
        units_done += 1
        unit = next_unit

    if WORK_STEALING and SPLIT_K > 1:
        # Work stealing spreads each tile's slice sum over all programs: SUM_ROWS rows of a
        # tile per sum unit, claimed from a counter of their own once every product unit has
        # been claimed. So a sum waits only for slices that running programs are computing,
        # however few programs run (a static schedule could wait on one not yet started).
        parts_per_tile = BLOCK_M // SUM_ROWS
        num_sums = (num_tiles - whole_tiles) * parts_per_tile
        sums_dry = 0
        # A program that left the products (or leaves now) leaves the sums too; the slices
        # they wait for are all claimed by programs that stay or finish them before leaving.
        leaving = _leaving(budget_ptr, pid)
        part, sums_dry = _claim_unit(sums_counter_ptr, status_ptr, 0, sums_dry, num_sums,
                                     num_programs, leaving, budget_ptr, 1, COUNTER_STRIDE)
        while part >= 0:
            split_tile = part // parts_per_tile
            row0 = (part % parts_per_tile) * SUM_ROWS
            # Bounded: only a wrong arrival count (a counter not zero at launch) keeps a
            # slice from arriving; then the rows are NaN and the status says why.
            arrived = tl.atomic_add(arrivals_ptr + split_tile, 0, sem="acquire")
            spins = 0
            while (arrived < SPLIT_K) & (spins < max_spins):
                arrived = tl.atomic_add(arrivals_ptr + split_tile, 0, sem="acquire")
                spins += 1
            acc = _slice_sum(partials_ptr, split_tile, row0, SPLIT_K, SUM_ROWS, BLOCK_M, BLOCK_N)
            if arrived < SPLIT_K:
                acc = tl.full((SUM_ROWS, BLOCK_N), float("nan"), tl.float32)
                tl.atomic_or(status_ptr, _WAIT_TIMED_OUT, sem="relaxed")
            leaving = _leaving(budget_ptr, pid)
            next_part, sums_dry = _claim_unit(sums_counter_ptr, status_ptr, 0, sums_dry, num_sums,
                                              num_programs, leaving, budget_ptr, 1, COUNTER_STRIDE)
            batch, tile_m, tile_n = _tile_coords(whole_tiles + split_tile, tiles_m, tiles_n, GROUP_M)
            # Pointer stores: the C descriptor's box is a whole tile.
            _store_tile(
                acc, c_ptr, c_desc, bias_ptr, batch, tile_m * BLOCK_M + row0, tile_n * BLOCK_N, M, N,
                stride_cb, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
                alpha, beta, SUM_ROWS, BLOCK_N, INT64_INDEX, False, ACTIVATION, GATE,
            )
            # The tile's last sum to finish leaves its arrival counter clean for the next launch.
            if tl.atomic_add(arrivals_ptr + split_tile, 1, sem="relaxed") == SPLIT_K + parts_per_tile - 1:
                tl.store(arrivals_ptr + split_tile, 0)
            units_done += 1
            part = next_part

    if CHECKED:
        tl.atomic_add(tally_ptr, units_done, sem="relaxed")


"""The work queue of one launch: how its work units are claimed, and the counters that
claiming uses. Every rule about those counters lives here and in the kernel's claim code
(kernel.py), which follows the layout below.

Work units are numbered 0..U-1 (each output tile's K slices next to each other; with a
split tail, the first `whole_tiles` tiles are a unit each, whole K, and only the tiles after
them are split, their slices numbered after the whole tiles) and split into `num_shards`
contiguous shards; each shard has one int32 claim counter. Under work
stealing a program claims units from its home shard, then from the others in order, and
asks every shard exactly once more after finding it dry. So the last claim a shard ever
gets returns its size plus the number of programs, minus one, and the program that gets it
resets the counter: every launch leaves its counters at zero, and no launch zeroes them
(counters.py hands the same buffer to every launch that cannot overlap another).

Under a live budget (budget.LiveBudget) programs may leave before a shard is dry, so a
shard's counter is the int64 at the start of its line: claims in the low half, departures
in the high half. A leaving program adds one departure to every shard it has not found dry,
instead of its dry claim; every program still ends with exactly one terminal op per shard,
and the op that sees num_programs - 1 of them before it (dry claims plus departures) resets
the counter. The split-K sums' queue works the same way.

Layout of a launch's int32 counters, each group on its own COUNTER_STRIDE line so that
programs hammering one never contend for another's cache line:

    line s (0 <= s < num_shards)  shard s's claim counter (int64 under a live budget)
    line num_shards               the tally: [0] work units done (checked launches only),
                                  [1] status bits (STATUS_*), set by the kernel on an
                                  impossible state, never cleared by it
    line num_shards + 1           split-K under work stealing: the sum units' claim counter
                                  (int64 under a live budget)
    then, for split-K             one arrival counter per split tile (slices stored, then sums done)

A launch whose counters are not all zero when it starts is in an impossible state: it can
skip units, compute some twice, or sum partials that were never written. The kernel bounds
every wait and flags what it can see (STATUS_*); a checked launch (launch.set_checked)
also tallies its units and the host compares the whole buffer with `problems()` before and
after the launch.
"""

import dataclasses

from tritonblas_ops.device import COUNTER_STRIDE

# Status bits the kernel sets (atomic or) in the tally line's second word.
STATUS_CLAIM_OUT_OF_RANGE = 1  # a claim returned more than size + programs - 1: stale counter
STATUS_WAIT_TIMED_OUT = 2  # a split-K sum gave up waiting for its slices and wrote NaN
STATUS_BAD_OFFSETS = 4  # a grouped launch's offs was malformed (its groups were clamped)
STATUS_NAMES = {
    STATUS_CLAIM_OUT_OF_RANGE: "a claim counter returned a value no launch can reach (it was not zero at launch)",
    STATUS_WAIT_TIMED_OUT: "a split-K sum gave up waiting for its slices (their arrival count was wrong); "
                           "its rows were written as NaN",
    STATUS_BAD_OFFSETS: "a grouped launch (ws_grouped_mm) got offs that were not non-decreasing ends "
                        "within the ragged dimension; its groups were clamped to fit",
}

# Polls of a tile's arrival counter before a split-K sum gives up (each poll is an L2
# round trip, so this bounds the wait at seconds: a slice being computed takes far less).
MAX_SPINS = 1 << 22


@dataclasses.dataclass(frozen=True)
class WorkQueue:
    num_shards: int
    num_tiles: int
    split_k: int
    sum_parts: int  # split-K sum units per tile under work stealing (1 otherwise)
    work_stealing: bool
    # With split-K, the tiles before this one are whole units (a split tail: only the last,
    # partial wave's tiles are split); 0 splits every tile.
    whole_tiles: int = 0

    @property
    def split_tiles(self) -> int:
        """Tiles whose K is split into split_k slices."""
        return self.num_tiles - self.whole_tiles if self.split_k > 1 else 0

    @property
    def product_units(self) -> int:
        """Work units that compute a product: whole tiles, and the split tiles' slices."""
        return self.num_tiles + self.split_tiles * (self.split_k - 1)

    @property
    def num_units(self) -> int:
        """Product units and, for split-K under work stealing, sum units."""
        sums = self.split_tiles * self.sum_parts if self.work_stealing else 0
        return self.product_units + sums

    @property
    def tally_offset(self) -> int:
        return self.num_shards * COUNTER_STRIDE

    @property
    def status_offset(self) -> int:
        return self.tally_offset + 1

    @property
    def arrivals_offset(self) -> int:
        return (self.num_shards + 2) * COUNTER_STRIDE

    @property
    def numel(self) -> int:
        """int32 counters the launch uses: all zero at launch, all zero after it."""
        if self.split_k == 1:
            return (self.num_shards + 1) * COUNTER_STRIDE
        return self.arrivals_offset + self.split_tiles

    def kernel_constants(self) -> dict:
        return dict(NUM_SHARDS=self.num_shards, COUNTER_STRIDE=COUNTER_STRIDE,
                    WORK_STEALING=self.work_stealing)

    def problems(self, counters: list[int], *, tally: int = 0) -> list[str]:
        """What is wrong with a launch's counters read back (a list of ints, at least
        `numel` long), none when all is well: every word zero, except the tally's unit
        count, which must equal `tally` (num_units after a checked launch ran)."""
        found = []
        status = counters[self.status_offset]
        for bit, name in STATUS_NAMES.items():
            if status & bit:
                found.append(name)
        if counters[self.tally_offset] != tally:
            found.append(f"{counters[self.tally_offset]} work units were computed, not {tally} "
                         f"(units skipped or computed twice)")
        for offset in range(self.numel):
            if offset in (self.tally_offset, self.status_offset) or counters[offset] == 0:
                continue
            found.append(f"{self._describe(offset)} is {counters[offset]}, not 0")
        return found

    def _describe(self, offset: int) -> str:
        line, word = divmod(offset, COUNTER_STRIDE)
        if offset >= self.arrivals_offset:
            return f"the arrival counter of tile {self.whole_tiles + offset - self.arrivals_offset}"
        if line < self.num_shards:
            return f"shard {line}'s claim counter" if word == 0 else f"padding word {offset}"
        if line == self.num_shards + 1 and word == 0:
            return "the split-K sums' claim counter"
        return f"padding word {offset}"

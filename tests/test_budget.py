"""SM budgets (tritonblas_ops/budget.py): the grid a launch runs under sm_budget and torch's
SM carve-out, read at each launch, and programs leaving a running launch under a
LiveBudget; results independent of both (the interpreter on CPU)."""

import collections
import contextlib

import pytest
import torch

import tritonblas_ops
from tritonblas_ops import budget, grouped, interpreter, launch
from tritonblas_ops import device as devices
from tritonblas_ops import kernel as kernel_module
from tritonblas_ops.config import TileConfig
from tritonblas_ops.grouped_kernel import ws_grouped_kernel
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.plan import Schedule
from tritonblas_ops.testing import REL_TOLERANCE, assert_every_unit_computed_once, assert_matches, matmul_ref

pytestmark = pytest.mark.usefixtures("poison_empty")


@pytest.fixture(autouse=True)
def no_budget():
    before = budget.get_sm_budget()
    tritonblas_ops.sm_budget(None)
    launch.clear_plans()
    yield
    tritonblas_ops.sm_budget(before)
    launch.clear_plans()


def test_setter_context_manager_and_bad_values():
    assert tritonblas_ops.get_sm_budget() is None
    tritonblas_ops.sm_budget(100)
    assert tritonblas_ops.get_sm_budget() == 100
    with tritonblas_ops.sm_budget(8):
        assert tritonblas_ops.get_sm_budget() == 8
        with tritonblas_ops.sm_budget(None):
            assert tritonblas_ops.get_sm_budget() is None
        assert tritonblas_ops.get_sm_budget() == 8
    assert tritonblas_ops.get_sm_budget() == 100
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="sm_budget takes a positive int or None"):
            tritonblas_ops.sm_budget(bad)
    assert tritonblas_ops.get_sm_budget() == 100


def test_program_limit_takes_the_budget_and_the_carveout(monkeypatch):
    cpu_programs = devices.num_compute_units(torch.device("cpu"))
    monkeypatch.setattr(devices, "num_compute_units",
                        lambda device: 132 if device.type == "cuda" else cpu_programs)
    carveout = [None]
    monkeypatch.setattr(budget, "_carveout", lambda: carveout[0])
    gpu = torch.device("cuda", 0)
    assert budget.program_limit(gpu) == 132
    carveout[0] = 16
    assert budget.program_limit(gpu) == 116
    with tritonblas_ops.sm_budget(100):
        assert budget.program_limit(gpu) == 100
    with tritonblas_ops.sm_budget(120):
        assert budget.program_limit(gpu) == 116
    carveout[0] = 132
    assert budget.program_limit(gpu) == 1  # at least one program
    assert budget.program_limit(torch.device("cpu")) == cpu_programs  # no carve-out there


@pytest.mark.parametrize("programs", [1, 2, 3])
def test_every_tile_once_and_the_same_bits_under_any_budget(programs):
    """The interpreter runs 4 programs unbudgeted; fewer steal what the others would have
    done (checked launches, on for the test session, verify every unit ran exactly once)."""
    assert launch.is_checked()
    a, b, bias = torch.randn(100, 70), torch.randn(70, 90), torch.randn(90)
    unbudgeted = torch.ops.tritonblas.ws_addmm(bias, a, b, beta=0.5, alpha=2.0)
    with tritonblas_ops.sm_budget(programs):
        budgeted = torch.ops.tritonblas.ws_addmm(bias, a, b, beta=0.5, alpha=2.0)
    assert torch.equal(budgeted, unbudgeted)
    assert_matches(budgeted, matmul_ref(a, b, bias, alpha=2.0, beta=0.5), REL_TOLERANCE[torch.float32])
    assert sorted({p.grid for p in launch.cached_plans()}) == sorted({programs, devices.INTERPRETER_PROGRAMS})


def test_compiled_op_calls_follow_the_budget_without_recompiling():
    """Routed (the op form), the plan is made at launch: a budget set after compiling
    changes the grid of the next call, and nothing recompiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    tritonblas_ops.route_cpu(True)
    try:
        counter = CompileCounterWithBackend("inductor")
        mm = torch.compile(torch.mm, backend=counter)
        a, b = torch.randn(100, 70), torch.randn(70, 90)
        full = mm(a, b)
        with tritonblas_ops.sm_budget(2):
            budgeted = mm(a, b)
        assert counter.frame_count == 1
        assert torch.equal(budgeted, full)
        assert sorted({p.grid for p in launch.cached_plans()}) == [2, devices.INTERPRETER_PROGRAMS]
    finally:
        tritonblas_ops.route_cpu(False)


# ---------------------------------------------------------------------------------------
# The live budget: programs leaving mid-launch (the interpreter, scripted)
# ---------------------------------------------------------------------------------------


class _ScriptedDepartures:
    """Stands in for the kernel's `_leaving` in interpreted launches: program p leaves at
    its (script[p] + 1)-th claim, that is after script[p] claims (None: it never leaves).
    The interpreter runs the programs one after another, so a real budget lowered
    mid-launch cannot be timed there; the script decides instead, for every program."""

    def __init__(self, script: dict):
        self.script = script
        self.asked = collections.Counter()

    def rewrite(self):
        def leaving(budget_ptr, pid):
            pid = int(pid.handle.data.item())
            self.asked[pid] += 1
            stays_for = self.script.get(pid)
            return stays_for is not None and self.asked[pid] > stays_for
        return leaving


@contextlib.contextmanager
def scripted_departures(script: dict, kernel=ws_matmul_kernel):
    helpers = interpreter.interpreted(kernel)._helpers
    key = id(kernel_module._leaving)
    before = helpers.get(key)
    helpers[key] = departures = _ScriptedDepartures(script)
    try:
        with tritonblas_ops.LiveBudget("cpu"):
            yield departures
    finally:
        if before is None:
            helpers.pop(key, None)
        else:
            helpers[key] = before


# program -> claims before it leaves (None: stays); the interpreter runs program 0 first,
# so the last program must stay to drain what the others left (on a GPU, program 0 stays).
DEPARTURE_SCRIPTS = {
    "some leave after a few units": {0: 2, 1: 0, 2: 5, 3: None},
    "all but one leave at once": {0: 0, 1: 0, 2: 0, 3: None},
    "the first does everything, the rest leave: a departure resets the counters": {0: None, 1: 0, 2: 0, 3: 0},
    "leaving in the split-K sums": {0: 7, 1: 9, 2: 11, 3: None},
}


@pytest.mark.parametrize("split_k,split_tail", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("script", list(DEPARTURE_SCRIPTS))
def test_live_budget_programs_leave_and_the_others_finish(script, split_k, split_tail):
    """Whatever programs leave when: every unit once (its counter), the right result, the
    counters zero after (twice on one buffer), and the bits of a launch without a budget.
    The split tail's case has 15 tiles: 12 whole, 3 split."""
    a, b = torch.randn(1, 70, 48), torch.randn(1, 48, 40 if split_tail else 50)
    config = TileConfig(16, 16, 16, num_warps=4, num_stages=1, split_k=split_k, split_tail=split_tail)
    free = tritonblas_ops.ws_matmul(a[0], b[0], config=config, num_shards=2, num_programs=4)
    with scripted_departures(DEPARTURE_SCRIPTS[script]) as departures:
        assert_every_unit_computed_once(a, b, config, num_shards=2, num_programs=4,
                                        schedule=Schedule.WORK_STEALING, tolerance=1e-5)
        budgeted = tritonblas_ops.ws_matmul(a[0], b[0], config=config, num_shards=2, num_programs=4)
    assert departures.asked[3] > 0  # the script ran
    assert torch.equal(budgeted, free)


@pytest.mark.parametrize("ragged", ["m", "k"])
@pytest.mark.parametrize("script", list(DEPARTURE_SCRIPTS)[:3])
def test_live_budget_grouped_programs_leave_and_the_others_finish(script, ragged):
    """The grouped launch (every expert's tiles in one queue) under departures: every unit
    once, counters zero after (a checked launch), the bits of a launch without a budget."""
    sizes = [9, 0, 30, 4, 21]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    a, b = ((torch.randn(70, 24), torch.randn(5, 24, 40)) if ragged == "m"
            else (torch.randn(40, 70), torch.randn(70, 24)))
    config = TileConfig(16, 16, 16, num_warps=4, num_stages=1)
    knobs = dict(config=config, num_shards=2, num_programs=4)
    free = grouped.grouped_mm(a, b, offs, **knobs)
    plan = grouped.plan_grouped(a, b, free, len(sizes), **knobs)
    counts = torch.zeros(plan.queue.num_tiles, dtype=torch.int32)
    with scripted_departures(DEPARTURE_SCRIPTS[script], ws_grouped_kernel) as departures:
        budgeted = grouped.grouped_mm(a, b, offs, unit_counts=counts, **knobs)
    units = grouped.num_units(plan, offs.tolist())
    assert departures.asked[3] > 0
    assert (counts[:units] == 1).all() and (counts[units:] == 0).all(), counts.tolist()
    assert torch.equal(budgeted, free)


def test_live_budget_is_read_by_launches_inside_its_block_only():
    a, b = torch.randn(40, 24), torch.randn(24, 32)
    live = tritonblas_ops.LiveBudget("cpu")
    with live:
        with pytest.raises(RuntimeError, match="already in use"):
            with tritonblas_ops.LiveBudget("cpu"):
                pass
        live.lower(1)
        torch.testing.assert_close(tritonblas_ops.ws_matmul(a, b), a @ b)
        assert [p.live_budget for p in launch.cached_plans()] == [live.word]
        assert live.word.item() == 1
        live.restore()
        assert live.word.item() == budget.UNLIMITED
    launch.clear_plans()
    tritonblas_ops.ws_matmul(a, b)
    assert [p.live_budget for p in launch.cached_plans()] == [None]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="one program must stay"):
            live.lower(bad)


def test_a_live_budget_in_use_or_not_keeps_both_plans_cached():
    """Entering and leaving a LiveBudget's block (say, once per training step) replans
    nothing: one cached plan reads the budget, one does not."""
    a, b = torch.randn(40, 24), torch.randn(24, 32)
    live = tritonblas_ops.LiveBudget("cpu")
    for _ in range(3):
        tritonblas_ops.ws_matmul(a, b)
        with live:
            tritonblas_ops.ws_matmul(a, b)
    plans = launch.cached_plans()
    assert len(plans) == 2
    assert {p.live_budget is live.word for p in plans} == {True, False}


def test_stream_write_falls_back_to_copies_once_the_driver_refuses(monkeypatch):
    """LiveBudget writes with the driver's stream write (word address, value, on the
    stream's handle); a driver that refuses it once is not asked again (the copy instead)."""
    calls = []

    def driver_write(stream_handle, address, value, flags):
        calls.append((stream_handle, address, value, flags))
        return 0 if len(calls) == 1 else 801  # CUDA_ERROR_NOT_SUPPORTED

    monkeypatch.setattr(budget, "_driver_stream_write", lambda: driver_write)
    monkeypatch.setattr(budget, "_stream_write_refused", budget.threading.Event())
    stream = collections.namedtuple("Stream", "cuda_stream")(1234)
    word = torch.zeros(1, dtype=torch.int32)
    assert budget._stream_write(stream, word, 77)
    assert calls == [(1234, word.data_ptr(), 77, 0)]
    assert not budget._stream_write(stream, word, 78)  # refused: the caller copies
    assert not budget._stream_write(stream, word, 79)
    assert len(calls) == 2
    monkeypatch.setattr(budget, "_driver_stream_write", lambda: None)  # ROCm, no driver library
    monkeypatch.setattr(budget, "_stream_write_refused", budget.threading.Event())
    assert not budget._stream_write(stream, word, 80)

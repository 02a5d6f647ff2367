"""SM budgets (tritonblas_ops/budget.py): the grid a launch runs under sm_budget and torch's
SM carve-out, read at each launch; results independent of it (the interpreter on CPU)."""

import pytest
import torch

import tritonblas_ops
from tritonblas_ops import budget, launch
from tritonblas_ops import device as devices
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref

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

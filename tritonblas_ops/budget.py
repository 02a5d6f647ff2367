"""SM budgets: how many programs (one per SM) a launch may run, read at every launch.

Work stealing makes any grid correct: every tile is computed exactly once by whichever
programs run. So a caller can leave SMs to other work (a collective, another model) by
capping the grid: `sm_budget(n)` for a call or a scope, or torch's own SM carve-out
(`torch._C._set_sm_carveout_experimental`, which cuBLAS honours too). The tile choice does
not depend on the budget, so neither do the results: only the grid (and, below a wave, the
schedule) changes.
"""

import threading

import torch

from tritonblas_ops import device as devices

_lock = threading.Lock()
_budget: int | None = None  # programs at most; None: one per SM
_carveout = getattr(torch._C, "_get_sm_carveout_experimental", lambda: None)


class sm_budget:
    """Cap the programs of every ws launch at `programs` (None lifts the cap): from now on
    when called, or inside the block as a context manager (the previous cap comes back at
    its end). Process-wide, like torch's SM carve-out, which is honoured as well: a launch
    runs at most the device's SMs less the carve-out, and at least one program.

    Read when a GEMM launches: eager calls of the ops and routed GEMMs of the op form (the
    default) follow the budget in force at the call, with no recompilation. The inline
    form's grid is fixed when its graph is compiled, and a CUDA graph replays the grid it
    captured."""

    def __init__(self, programs: int | None):
        if programs is not None and (type(programs) is not int or programs < 1):
            raise ValueError(f"sm_budget takes a positive int or None, got {programs!r}")
        global _budget
        with _lock:
            self._before, _budget = _budget, programs

    def __enter__(self) -> "sm_budget":
        return self

    def __exit__(self, *exc) -> None:
        global _budget
        with _lock:
            _budget = self._before


def get_sm_budget() -> int | None:
    return _budget


def key() -> tuple:
    """What program_limit depends on besides the device (part of a cached plan's key)."""
    return _budget, _carveout()


def program_limit(device: torch.device) -> int:
    """Programs a launch on `device` may run now."""
    units = devices.num_compute_units(device)
    limit = units if _budget is None else min(units, _budget)
    carveout = _carveout() if device.type == "cuda" else None
    if carveout:
        limit = min(limit, units - carveout)
    return max(1, limit)

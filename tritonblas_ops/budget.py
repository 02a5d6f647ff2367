"""SM budgets: how many programs (one per SM) a launch may run.

Work stealing makes any grid correct: every tile is computed exactly once by whichever
programs run. So a caller can leave SMs to other work (a collective, another model):
- before a launch, by capping its grid: `sm_budget(n)` for a call or a scope, or torch's
  own SM carve-out (`torch._C._set_sm_carveout_experimental`, which cuBLAS honours too),
  read at every launch;
- while GEMMs run, with a `LiveBudget`: a word in device memory that the programs of every
  ws launch on its device read between work units; programs at or above it finish the
  unit they hold and leave, and the others take over their work. Lowering it is a
  stream write of one int on any stream, which needs no SM.
The tile choice depends on neither, so neither do the results: only the grid, the
programs that stay and (below a wave) the schedule change.
"""

import ctypes
import functools
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


# Any budget at or above every grid: no program leaves.
UNLIMITED = 2**31 - 1

_live: dict = {}  # device index ("cpu" for the CPU) -> the LiveBudget its launches read


class LiveBudget:
    """A budget in device memory that running GEMMs follow: programs of a ws launch whose
    index is at or above it finish the work unit they hold (one tile, or one K slice or
    sum of one) and leave; the others compute what they would have. Inside `with budget:`
    every ws launch on its device (eager, the op form of routed GEMMs, and launches captured
    in CUDA graphs then, whenever they replay) reads it; one LiveBudget per device at a time.

        budget = tritonblas_ops.LiveBudget()          # the current CUDA device
        with budget:
            y = model(x)                              # GEMMs queued on the compute stream
            with torch.cuda.stream(comm_stream):
                budget.lower(132 - 16, comm_stream)   # 16 SMs freed after a unit or two
                dist.all_reduce(grads)                # ... for the collective launched behind it
                budget.restore(comm_stream)           # launches from here on run all programs

    lower() and restore() write the word on `stream` with the driver's stream write
    (cuStreamWriteValue32: the GPU's front end does it, no SM and no copy engine; on an idle
    H200 it lands ~6 us after the call, a pinned 4-byte copy ~23 us), or with such a copy
    where there is none (ROCm, CUDA graph capture, a driver that refuses it). Programs only leave: raising the budget reaches launches that
    start after it, not those running. Results are bitwise those without a budget, whatever
    it did. Launches compiled into Inductor's code (the inline routing form) do not read it.
    """

    def __init__(self, device: torch.device | str | int | None = None):
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.word = torch.full((1,), UNLIMITED, dtype=torch.int32, device=device)
        self._host: dict[int, torch.Tensor] = {}  # value -> its pinned copy, kept while queued copies may read it
        self._host_lock = threading.Lock()

    def lower(self, programs: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Programs at or above `programs` (>= 1) leave after their current unit: on `stream`
        (the current one if None), in its order."""
        if type(programs) is not int or programs < 1:
            raise ValueError(f"LiveBudget.lower takes an int >= 1 (one program must stay), got {programs!r}")
        self._write(min(programs, UNLIMITED), stream)

    def restore(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """No limit for launches that start after this write on `stream`."""
        self._write(UNLIMITED, stream)

    def _write(self, value: int, stream) -> None:
        if self.device.type != "cuda":
            self.word.fill_(value)  # CPU (the interpreter's tests): synchronous
            return
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            # A failed driver call would invalidate a capture: graphs get the copy.
            if not torch.cuda.is_current_stream_capturing() and _stream_write(stream, self.word, value):
                return
            with self._host_lock:
                host = self._host.get(value)
                if host is None:
                    host = self._host[value] = torch.full((1,), value, dtype=torch.int32).pin_memory()
            self.word.copy_(host, non_blocking=True)

    def __enter__(self) -> "LiveBudget":
        index = _index(self.device)
        with _lock:
            if index in _live:
                raise RuntimeError(f"a LiveBudget is already in use on {self.device}")
            _live[index] = self
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            if _live.get(_index(self.device)) is self:
                del _live[_index(self.device)]


@functools.cache
def _driver_stream_write():
    """cuStreamWriteValue32 from the CUDA driver, or None (ROCm, no driver library)."""
    if torch.version.hip is not None:
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    write = getattr(driver, "cuStreamWriteValue32_v2", None) or getattr(driver, "cuStreamWriteValue32", None)
    if write is not None:
        write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        write.restype = ctypes.c_int
    return write


_stream_write_refused = threading.Event()  # the driver said no once: copies from then on


def _stream_write(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> bool:
    """Queue word[0] = value on `stream` as a driver stream write; False where there is none."""
    write = _driver_stream_write()
    if write is None or _stream_write_refused.is_set():
        return False
    # Flags 0: the write waits for the stream's earlier work and its memory writes.
    if write(stream.cuda_stream, word.data_ptr(), value, 0) != 0:
        _stream_write_refused.set()
        return False
    return True


def _index(device: torch.device):
    return device.index if device.type == "cuda" else device.type


def live_budget_word(device: torch.device) -> torch.Tensor | None:
    """The word of the LiveBudget in use on `device`, or None."""
    live = _live.get(_index(device))
    return live.word if live is not None else None


def key(device_index: int) -> tuple:
    """What program_limit and live_budget_word depend on besides the device (part of a
    cached plan's key); device_index as Tensor.get_device() gives it (-1: the CPU)."""
    live = _live.get(device_index if device_index >= 0 else "cpu")
    return _budget, _carveout(), None if live is None else id(live.word)


def program_limit(device: torch.device) -> int:
    """Programs a launch on `device` may run now."""
    units = devices.num_compute_units(device)
    limit = units if _budget is None else min(units, _budget)
    carveout = _carveout() if device.type == "cuda" else None
    if carveout:
        limit = min(limit, units - carveout)
    return max(1, limit)

"""Counter buffers that outlive launches, so that no launch pays for zeroing its own.

Every launch leaves its counters at zero (scheduler.py), so a buffer is zeroed once and
handed to every launch that cannot run at the same time as another launch using it. That
saves a fill kernel per launch (benchmarks/NOTES.md steps 12 and 13).

- Eager CUDA launches: one buffer per (device, stream); a stream runs its launches one
  after the other.
- Launches captured in a CUDA graph: each takes its own slice of a slab zeroed before any
  capture, and no one else ever gets that slice: the graph may be replayed at any time on
  any stream, beside other graphs, while replays of one graph never overlap (CUDA orders
  each launch of a graph after the last one). With no slab yet (no eager call came first)
  or the slab spent, the launch gets zeros of its own: a memset node in the graph.
- CPU tensors (the interpreter): one buffer; interpreted launches run one at a time, and
  launch.py re-zeroes it under the interpreter's lock when a launch raised midway.
A launch that raised on a GPU never ran, so its buffer is still zero and stays in use.
Anything traced (fake or functional tensors) allocates zeros, which enter the graph.

Safe under concurrent callers: a buffer is made or grown under the lock, and a buffer
that is replaced stays alive (launches queued before may still use it).
"""

import concurrent.futures
import threading

import torch

from tritonblas_ops import fastpath
from tritonblas_ops.device import COUNTER_STRIDE

# int32 elements per device for captured launches: 4 MiB, ~500 captured launches of 8 shards.
GRAPH_SLAB_ELEMENTS = 2**20

_lock = threading.Lock()
_eager: dict[tuple, torch.Tensor] = {}  # (device, stream) -> zeroed buffer
_slabs: dict[int, torch.Tensor] = {}  # device index -> zeroed slab for captured launches
_slab_used: dict[int, int] = {}  # device index -> elements handed out
_replaced: list[torch.Tensor] = []  # GPU buffers outgrown, kept alive (see zeroed)


def zeroed(numel: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of at least `numel` zeros, for one launch on the current stream,
    which the launch must leave at zero."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _captured(numel, device)
        key = (device.index, fastpath.current_stream(device.index))
    else:
        key = (device.type, device.index)
    buffer = _eager.get(key)
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    with _lock:
        buffer = _eager.get(key)  # another thread may have made or grown it meanwhile
        if buffer is None or buffer.numel() < numel:
            grown = max(numel, 2 * buffer.numel() if buffer is not None else 0)  # by doubling
            if buffer is not None and buffer.is_cuda:
                # Launches queued before may still use it, and its block belongs to the
                # allocating thread's stream, not theirs: the allocator could hand it out
                # under them.
                _replaced.append(buffer)
            buffer = _eager[key] = _lasting_zeros(grown, device)
            if device.type == "cuda" and device.index not in _slabs:
                _slabs[device.index] = _lasting_zeros(GRAPH_SLAB_ELEMENTS, device)
                _slab_used[device.index] = 0
    return buffer


def _lasting_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """Zeros that outlive the call, zeroed by the time this returns. On a GPU they are
    allocated by a thread of their own: CUDA graph trees send every allocation of the thread
    that warms up or records a graph to the graph's private pool, whose blocks they free
    and hand out again by their own bookkeeping, which knows nothing of these buffers (and
    a capture may begin with no sync, then replay on another stream)."""
    if device.type != "cuda":
        return torch.zeros(numel, dtype=torch.int32, device=device)

    def allocate():
        zeros = torch.zeros(numel, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).synchronize()
        return zeros

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(allocate).result()


def _captured(numel: int, device: torch.device) -> torch.Tensor:
    with _lock:
        slab, used = _slabs.get(device.index), _slab_used.get(device.index, 0)
        if slab is None or used + numel > slab.numel():
            return torch.zeros(numel, dtype=torch.int32, device=device)
        # Whole COUNTER_STRIDE lines: no two launches' counters share a cache line.
        _slab_used[device.index] = used + -(-numel // COUNTER_STRIDE) * COUNTER_STRIDE
        return slab[used:used + numel]


def spend_slab(device: torch.device) -> None:
    """Hand out the rest of `device`'s graph slab to nobody (tests of the spent slab)."""
    with _lock:
        if device.index in _slabs:
            _slab_used[device.index] = _slabs[device.index].numel()

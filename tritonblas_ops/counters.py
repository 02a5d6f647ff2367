"""Counter buffers that outlive launches, so that no launch pays for zeroing its own.

A work-stealing launch leaves its counters at zero: every program finds every shard dry
exactly once, so the last claim on a shard returns the shard's size plus the grid size
minus one, and the program that gets it resets the counter; a split-K tile's last slice
resets its arrival counter. A buffer is therefore zeroed once and reused by every launch
that cannot run at the same time as another launch using it. That saves a fill kernel per
launch: ~7 us of host time on an eager call, a 0.8 us memset node in a CUDA graph (the
H200, NOTES.md steps 12 and 13).

- Eager CUDA launches: one buffer per (device, stream); a stream runs its launches one
  after the other.
- Launches captured in a CUDA graph: each takes its own slice of a slab zeroed before any
  capture, and no one else ever gets that slice: the graph may be replayed at any time on
  any stream, beside other graphs, while replays of one graph never overlap (CUDA orders
  each launch of a graph after the last one). With no slab yet (no eager call came first)
  or the slab spent, the launch gets zeros of its own: a memset node in the graph.
- CPU tensors (the interpreter): one buffer; interpreted launches run one at a time.
A launch that raises discards its buffer (discard).
Anything traced (fake or functional tensors) allocates zeros, which enter the graph.
"""

import concurrent.futures
import threading

import torch

from tritonblas_ops.device import COUNTER_STRIDE

# int32 elements per device for captured launches: 4 MiB, ~500 captured launches of 8 shards.
GRAPH_SLAB_ELEMENTS = 2**20

_lock = threading.Lock()
_eager: dict[tuple, torch.Tensor] = {}  # (device, stream) -> zeroed buffer
_slabs: dict[int, torch.Tensor] = {}  # device index -> zeroed slab for captured launches
_slab_used: dict[int, int] = {}  # device index -> elements handed out
_outgrown: list[torch.Tensor] = []  # retired GPU buffers, kept alive (_retire)


def zeroed(numel: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of at least `numel` zeros, for one launch on the current stream,
    which the launch must leave at zero."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _captured(numel, device)
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    else:
        key = (device.type, device.index)
    buffer = _eager.get(key)
    if buffer is None or buffer.numel() < numel:
        with _lock:
            grown = max(numel, 2 * buffer.numel() if buffer is not None else 0)  # by doubling
            if buffer is not None:
                _retire(buffer)
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


def discard(buffer: torch.Tensor) -> None:
    """Forget a buffer whose launch failed: a launch interrupted after its first claim (the
    interpreter raising inside the kernel) leaves its counters set; the next launch gets
    fresh zeros. On a GPU a launch that raises never ran, and a kernel that faults ends
    the process's CUDA context, so there this only costs one allocation."""
    with _lock:
        for key, kept in list(_eager.items()):
            if kept is buffer:
                del _eager[key]
                _retire(kept)


def _retire(buffer: torch.Tensor) -> None:
    """Drop a buffer no launch will be given again. A GPU one is kept alive: launches
    queued before may still use it, and its block belongs to the allocating thread's
    stream, not theirs, so the allocator could hand it out under them."""
    if buffer.is_cuda:
        _outgrown.append(buffer)


def _captured(numel: int, device: torch.device) -> torch.Tensor:
    with _lock:
        slab, used = _slabs.get(device.index), _slab_used.get(device.index, 0)
        if slab is None or used + numel > slab.numel():
            return torch.zeros(numel, dtype=torch.int32, device=device)
        # Whole COUNTER_STRIDE lines: no two launches' counters share a cache line.
        _slab_used[device.index] = used + -(-numel // COUNTER_STRIDE) * COUNTER_STRIDE
        return slab[used:used + numel]

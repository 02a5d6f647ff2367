"""Running test work in many threads at once, so that races show up."""

import contextlib
import sys
import threading
import time


def run_in_threads(work, count: int, timeout_s: float = 300.0) -> list:
    """work(0) ... work(count - 1), each in its own thread, all released at once. Returns the
    results; re-raises the first exception a thread raised; a hung thread fails the test."""
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def body(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread below)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread did not finish: deadlock?"
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def frequent_thread_switches():
    """Let the interpreter switch threads every 10 us (default 5 ms), so races show up."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)

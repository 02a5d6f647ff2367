"""GEMM throughput while another stream holds H SMs (METHOD.md, "Contention").

Per trial: the hog takes H SMs on its own stream; on the GEMM stream a one-SM delay kernel
gives it a head start (DELAY_MS), then several GEMMs run back to back between two CUDA
events. A trial counts only if the hog was still running when the last GEMM ended and
the delay was still running when the host had queued the last GEMM (so host launch gaps
are not in the window); otherwise it is redone with longer times.
"""

import math

import torch

from benchmarks import sm_hog

DELAY_MS = 2.0
WINDOW_MS = 5.0  # un-held time the back-to-back GEMMs of one trial add up to, at least
MIN_GEMMS = 3
TRIALS = 7
# Hog duration over the worst case: a persistent grid of one program per SM runs in
# ceil(SMs / (SMs - H)) waves when only SMs - H are free.
SAFETY = 2.0
ATTEMPTS = 4


def gemms_per_window(unheld_ms: float) -> int:
    return max(MIN_GEMMS, math.ceil(WINDOW_MS / unheld_ms))


def held_ms_per_gemm(call, gemms: int, held: int, unheld_ms: float, num_sms: int,
                     streams: tuple[torch.cuda.Stream, torch.cuda.Stream]) -> float:
    """Milliseconds per GEMM, averaged over `gemms` back-to-back calls, while `held` SMs are held."""
    waves = math.ceil(num_sms / (num_sms - held))
    delay_ms = DELAY_MS
    busy_ms = SAFETY * gemms * unheld_ms * waves
    for _ in range(ATTEMPTS):
        window = _window_ms(call, gemms, held, delay_ms, delay_ms + busy_ms, streams)
        if window is not None:
            return window / gemms
        delay_ms, busy_ms = 2 * delay_ms, 2 * busy_ms
    raise RuntimeError(f"no clean held window after {ATTEMPTS} attempts (H={held}, {gemms} GEMMs)")


def _window_ms(call, gemms, held, delay_ms, hold_ms, streams):
    hog_stream, gemm_stream = streams
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # the previous trial's hog is gone; inputs are ready
    hog = sm_hog.hold_sms(held, hold_ms, hog_stream) if held else None
    with torch.cuda.stream(gemm_stream):
        delay = sm_hog.hold_sms(1, delay_ms)
        start.record()
        for _ in range(gemms):
            call()
        end.record()
    queued_in_time = delay.active()
    end.synchronize()
    if hog is not None:
        held_throughout = hog.active()
        hog.check_distinct_sms()
        if not held_throughout:
            return None
    return start.elapsed_time(end) if queued_in_time else None

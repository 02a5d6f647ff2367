"""Routing policy "auto" (the default): route a GEMM only where the kernel is predicted to be
at least as fast as what Inductor runs in its place on an idle GPU (cuBLAS, and, for a GEMM
whose epilogue fusion takes an activation or a gated product, the pointwise kernel the
fusion removes). Predicted from the corpus measured on that GPU (measured.py), never by
timing at run time:

- neighbours: the measured shapes of the GEMM's dtype and alignment class whose M, N and K
  are each within a factor of 2 of its own (M counted as at least 16: a decode GEMM of
  fewer rows reads the same weight in the same time);
- cuBLAS's time: the nearest neighbour's, scaled by the work (M * N * K, M as above);
- the kernel's time: cuBLAS's times the worst ratio of the kernel's time to cuBLAS's among
  the neighbours (a conservative estimate);
- a fused epilogue saves passes over output-sized memory (`saved_passes`: 2 where it takes
  an activation, a gated product or an activation's backward, whose pointwise kernel read
  the GEMM's output once more and wrote its own; 1 for a residual add, which Inductor may
  fold into the next kernel), at the best bandwidth measured there; and where it reads an
  output-sized operand (`read_passes`: a gate, a pre-activation, a residual), that read
  costs the kernel more than it cost the pointwise kernel (EPILOGUE_OPERAND_GBPS);
- a GEMM whose predicted time is below HOST_BOUND_MULTIPLE times the op's host time per
  call runs where the step is bound by the host, and the opaque op costs the host more than
  what it replaces: not routed, unless the graph is compiled for CUDA graphs
  (`mode="reduce-overhead"`), whose replays pay no host time per GEMM.
Not routed either: a GPU without measurements (warned once per device), batched and grouped
GEMMs (none measured yet), FP32 without TF32, and any GEMM without a measured neighbour.
Each decision and its reason is logged at DEBUG to the "tritonblas_ops.policy" logger.
"""

import dataclasses
import functools
import logging
import math
import warnings

import torch

from tritonblas_ops import measured

log = logging.getLogger(__name__)

DECODE_ROWS = 16  # up to this many rows, a GEMM's time does not depend on M (measured.py)
NEIGHBOURHOOD = 1.0  # log2 of the largest factor between a neighbour's size and the GEMM's
# The rate a fused epilogue's output-sized operand costs the kernel: the operand's bytes
# over (fused - plain GEMM). Measured on the H200 (benchmarks/RESULTS.md, "Fused epilogues
# that read an operand"; python -m benchmarks.epilogues), the warp-specialized kernel reading
# it ahead during the K loop: 796-6800 GB/s over 5 shapes and 3 epilogues (a silu gate
# 1665-2715, GELU's slope 985-1403: its erf is paid per element too; a residual 796-6802).
# The low end, to route only where the fused op wins.
EPILOGUE_OPERAND_GBPS = 800.0
# Without CUDA graphs a compiled step of short kernels is bound by the host: on an H100 the
# GPT-2 MLP's forward (kernels of 30-60 us) issued 144 us of host time for a 169 us step,
# and routing its 61 us GEMM added ~37 us of host time and lost 9-29% (NOTES.md step 50).
# A routed GEMM must run this many op host times (~100 us) for what it adds to hide behind it.
HOST_BOUND_MULTIPLE = 4


@dataclasses.dataclass(frozen=True)
class Prediction:
    cublas_us: float
    kernel_us: float
    saved_us: float  # by the fused epilogue: the memory passes it saves
    read_us: float = 0.0  # by the fused epilogue: its operand reads, beyond a pointwise kernel's

    @property
    def routes(self) -> bool:
        return self.kernel_us + self.read_us <= self.cublas_us + self.saved_us


def alignment_class(n: int, k: int, element_size: int) -> str:
    """How rows of the operands start (row-major A: pitch K; B and the output: pitch N):
    "unaligned" (not 16-byte multiples: no TMA), "mid-line" (16- but not 128-byte multiples:
    rows start inside an L2 line), else "aligned"."""
    pitches = (n * element_size, k * element_size)
    if any(p % 16 for p in pitches):
        return "unaligned"
    if any(p % 128 for p in pitches):
        return "mid-line"
    return "aligned"


def predict(gpu: dict, dtype: torch.dtype, m: int, n: int, k: int, *, saved_passes: int,
            read_passes: int = 0) -> Prediction | None:
    """The kernel's and cuBLAS's predicted times for one GEMM on a measured GPU, or None
    where no measured shape is near enough."""
    shapes = gpu["shapes"].get(str(dtype).removeprefix("torch."), ())
    element_size = dtype.itemsize
    wanted = alignment_class(n, k, element_size)
    rows = max(m, DECODE_ROWS)
    neighbours = []
    for mm, nn, kk, cublas_us, kernel_us in shapes:
        if alignment_class(nn, kk, element_size) != wanted:
            continue
        their_rows = max(mm, DECODE_ROWS)
        distance = max(abs(math.log2(rows / their_rows)), abs(math.log2(n / nn)), abs(math.log2(k / kk)))
        if distance <= NEIGHBOURHOOD:
            scaled_us = cublas_us * (rows * n * k) / (their_rows * nn * kk)
            neighbours.append((distance, scaled_us, kernel_us / cublas_us))
    if not neighbours:
        return None
    _, cublas_us, _ = min(neighbours)
    slowdown = max(ratio for _, _, ratio in neighbours)
    pass_bytes = m * n * element_size
    saved_us = saved_passes * pass_bytes / (gpu["bandwidth_gbps"] * 1e3)
    read_us = read_passes * pass_bytes * (1 / EPILOGUE_OPERAND_GBPS - 1 / gpu["bandwidth_gbps"]) / 1e3
    return Prediction(cublas_us, cublas_us * slowdown, saved_us, max(read_us, 0.0))


def faster(device: torch.device, dtype: torch.dtype, batches: int, m: int, n: int, k: int, *,
           saved_passes: int = 0, read_passes: int = 0, grouped: bool = False, tf32: bool = False,
           graphed: bool = False) -> bool:
    """Policy "auto"'s decision for one GEMM (its dtype, size hints, the output-sized memory
    passes an epilogue fused into it saves and the output-sized operands it reads); `tf32`: whether FP32 GEMMs may run as
    TF32 (the measured FP32 runs did); `graphed`: CUDA graphs replay it (no host time per
    call). CPU GEMMs (routed with route_cpu, run by the interpreter) are all routed."""
    gpu = measurements(device)
    if gpu is None:
        return device.type == "cpu"  # route_cpu's interpreter: no speed to predict
    routes, reason = _decide(gpu, dtype, batches, m, n, k, saved_passes, read_passes, grouped, tf32, graphed)
    if log.isEnabledFor(logging.DEBUG):
        what = f"{'grouped ' if grouped else ''}{batches}x{m}x{n}x{k} {dtype}{' fused' if saved_passes else ''}"
        log.debug("policy auto %s %s: %s", "routes" if routes else "leaves to Inductor", what, reason)
    return routes


def _decide(gpu: dict, dtype, batches, m, n, k, saved_passes, read_passes, grouped, tf32,
            graphed) -> tuple[bool, str]:
    if batches != 1 or grouped:
        return False, "no batched or grouped GEMM measured"
    if dtype == torch.float32 and not tf32:
        return False, "FP32 measured as TF32 only"
    predicted = predict(gpu, dtype, m, n, k, saved_passes=saved_passes, read_passes=read_passes)
    if predicted is None:
        return False, "no measured shape within 2x"
    times = (f"kernel {predicted.kernel_us:.1f} us + {predicted.read_us:.1f} us of epilogue reads, "
             f"cuBLAS {predicted.cublas_us:.1f} us + {predicted.saved_us:.1f} us saved by the fused epilogue")
    if predicted.kernel_us < HOST_BOUND_MULTIPLE * gpu["host_us"] and not graphed:
        return False, f"{times}: under {HOST_BOUND_MULTIPLE}x the op's host time ({gpu['host_us']} us), no CUDA graphs"
    return predicted.routes, times


def measurements(device: torch.device) -> dict | None:
    """measured.py's entry for this CUDA device (its name and SM count), or None (warned
    once per device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    return _measurements(properties.name, properties.multi_processor_count)


@functools.cache
def _measurements(name: str, num_sms: int) -> dict | None:
    for gpu in measured.GPUS:
        if gpu["device"] == name and gpu["num_sms"] == num_sms:
            return gpu
    warnings.warn(
        f"tritonblas_ops: routing policy 'auto' has no measurements for {name} ({num_sms} SMs), "
        "so it leaves every GEMM there to Inductor. tritonblas_ops.set_policy('all') routes "
        "them all; `python -m benchmarks.policy_table` turns corpus runs on this GPU into "
        "measurements.", stacklevel=2)
    return None

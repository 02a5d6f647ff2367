"""Hold H SMs busy for a while from another stream: the contention a GEMM sees when it
shares the GPU with, say, an NCCL all-reduce (METHOD.md, "Contention").

One block of 32 warps spins on %globaltimer per held SM. Each block also keeps 64 int32
values per thread live across the spin (loaded before it, stored after it), so it takes
64 registers x 1024 threads = the whole 64K register file of its SM. Nothing else fits
beside it: not a second hog block (so the H blocks land on H distinct SMs) and not a
block of the GEMM. `Hog.launch` checks both facts. A `Hog` allocates its buffers once, so
each launch queues the kernel alone: allocating them queues fill kernels, which need SMs
too (the handoff benchmark times a launch from its request).
"""

import dataclasses

import torch
import triton
import triton.language as tl

NUM_WARPS = 32
REGISTERS_PER_SM = 64 * 1024  # every NVIDIA GPU since Maxwell (sm_50)
BALLAST = REGISTERS_PER_SM  # int32 values per block: 64 per thread at 1024 threads


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit(do_not_specialize=["duration_ns"])
def _hold_kernel(ballast_ptr, sm_ids_ptr, duration_ns, BALLAST: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BALLAST + tl.arange(0, BALLAST)
    # Loaded, not computed, so the compiler cannot rematerialize it after the loop; the
    # timer read has side effects, so the load cannot sink below the loop either.
    ballast = tl.load(ballast_ptr + offs)
    start = _globaltimer()
    while _globaltimer() - start < duration_ns:
        pass
    tl.store(ballast_ptr + offs, ballast + 1)
    tl.store(sm_ids_ptr + pid, _sm_id())


@dataclasses.dataclass
class Hold:
    sm_ids: torch.Tensor  # int32 (H,): the SM each block ran on, valid once `done`
    done: torch.cuda.Event  # recorded on the hog's stream right after the kernel

    def active(self) -> bool:
        """Whether the hog is still holding its SMs (the kernel has not finished)."""
        return not self.done.query()

    def check_distinct_sms(self) -> None:
        """After it finished: every block ran on its own SM."""
        self.done.synchronize()
        held = self.sm_ids.tolist()
        if len(set(held)) != len(held):
            raise RuntimeError(f"hog blocks shared SMs, so fewer than {len(held)} were held: {sorted(held)}")


class Hog:
    """The kernel for `num_sms` SMs, its buffers allocated once on `stream` (default: the
    current one), where every launch goes: one stream, so no launch reads them before they
    are filled. Holds of one Hog share sm_ids: check a hold before the next launch."""

    def __init__(self, num_sms: int, stream: torch.cuda.Stream | None = None):
        self.num_sms = num_sms
        self.stream = stream or torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            self.ballast = torch.zeros(num_sms * BALLAST, dtype=torch.int32, device="cuda")
            # Not reset between launches: every block overwrites its own entry.
            self.sm_ids = torch.full((num_sms,), -1, dtype=torch.int32, device="cuda")

    def launch(self, duration_ms: float) -> Hold:
        """Occupy the SMs for `duration_ms`. Returns at once; the hold starts when the GPU
        runs the kernel."""
        with torch.cuda.stream(self.stream):
            compiled = _hold_kernel[(self.num_sms,)](self.ballast, self.sm_ids, int(duration_ms * 1e6),
                                                     BALLAST=BALLAST, num_warps=NUM_WARPS)
            done = torch.cuda.Event()
            done.record(self.stream)
        registers = compiled.n_regs * NUM_WARPS * 32
        if registers < REGISTERS_PER_SM:
            raise RuntimeError(f"a hog block uses {registers} registers, less than its SM's "
                               f"{REGISTERS_PER_SM}: other blocks could share the SM")
        return Hold(self.sm_ids, done)


def hold_sms(num_sms: int, duration_ms: float, stream: torch.cuda.Stream | None = None) -> Hold:
    """Occupy `num_sms` whole SMs for `duration_ms`, on `stream` (default: the current one),
    with buffers of its own. Returns at once; the hold starts when the GPU runs the kernel.
    """
    return Hog(num_sms, stream).launch(duration_ms)

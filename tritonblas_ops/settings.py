"""The routing settings: one object, read from the environment at import, changed only
through `update()` (which enable(), disable(), routing(), route_cpu(), set_policy() and
batch_invariant(), fuse_epilogues() and warp_specialize() call).

The settings decide which GEMMs of graphs compiled from then on reach the kernel
(lowering.py), and one decides the numerics of every launch, eager or compiled
(batch_invariant); graphs already compiled keep their code. They are process-wide, like
torch's own compile settings: change them between compiles, not while another thread
compiles.
"""

import contextlib
import dataclasses
import enum
import os
import threading

ROUTING_ENV = "TRITONBLAS_OPS_ROUTING"  # on by default; 0 / false / off / no turn it off
POLICY_ENV = "TRITONBLAS_OPS_POLICY"  # "auto" (default), "shared" or "all"
PATH_ENV = "TRITONBLAS_OPS_ROUTING_PATH"  # "opaque" (default) or "inline"
BATCH_INVARIANT_ENV = "TRITONBLAS_OPS_BATCH_INVARIANT"  # off by default
FUSE_EPILOGUES_ENV = "TRITONBLAS_OPS_FUSE_EPILOGUES"  # off by default
WARP_SPECIALIZE_ENV = "TRITONBLAS_OPS_WARP_SPECIALIZE"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def parse_bool(variable: str, value: str) -> bool:
    """An environment variable's on/off value, in any of the usual spellings."""
    spelled = value.strip().lower()
    if spelled in _TRUE:
        return True
    if spelled in _FALSE:
        return False
    raise ValueError(f"{variable} must be one of {', '.join(_TRUE + _FALSE)}, got {value!r}")


class Policy(enum.Enum):
    AUTO = "auto"  # eligible GEMMs the kernel is predicted to run at least as fast (policy.py)
    SHARED = "shared"  # those within ~10% of cuBLAS alone, which win once SMs are held
    ALL = "all"  # every eligible GEMM


class Path(enum.Enum):
    OPAQUE = "opaque"  # a call of the torch.ops.tritonblas op
    INLINE = "inline"  # the Triton kernel in Inductor's generated code


@dataclasses.dataclass(frozen=True)
class RoutingSettings:
    enabled: bool = True
    policy: Policy = Policy.AUTO
    path: Path = Path.OPAQUE
    # CPU GEMMs routed too: compiled code then calls the ops, which run the kernel through
    # Triton's interpreter. Slow; for tests and demos on machines without a GPU.
    cpu: bool = False
    # The inline path for CPU tensors as well: code generation only (tests check it against
    # a stand-in CUDA target); nothing can run it.
    inline_cpu: bool = False
    # Every launch sums each output element in an order that does not depend on M (nor on
    # the batch count): plan.py's tile choice ignores them, with no K split and no swap.
    batch_invariant: bool = False
    # A routed GEMM and the activation after it become one ws_mm_act call, a GLU's product
    # or an activation's backward of a GEMM one ws_mm_gated call (fusion.py).
    fuse_epilogues: bool = False
    # Launches on Hopper that the warp-specialized kernel can take run it
    # (plan.warp_specialized_eligible); the same bits as the Triton kernel's.
    warp_specialize: bool = True

    @classmethod
    def from_environment(cls) -> "RoutingSettings":
        return cls(
            enabled=parse_bool(ROUTING_ENV, os.environ.get(ROUTING_ENV, "1")),
            policy=_choice(Policy, POLICY_ENV, os.environ.get(POLICY_ENV, Policy.AUTO.value)),
            path=_choice(Path, PATH_ENV, os.environ.get(PATH_ENV, Path.OPAQUE.value)),
            batch_invariant=parse_bool(BATCH_INVARIANT_ENV, os.environ.get(BATCH_INVARIANT_ENV, "0")),
            fuse_epilogues=parse_bool(FUSE_EPILOGUES_ENV, os.environ.get(FUSE_EPILOGUES_ENV, "0")),
            warp_specialize=parse_bool(WARP_SPECIALIZE_ENV, os.environ.get(WARP_SPECIALIZE_ENV, "1")),
        )


def _choice(choice: type[enum.Enum], variable: str, value) -> enum.Enum:
    if isinstance(value, choice):
        return value
    try:
        return choice(value)
    except ValueError:
        allowed = ", ".join(repr(c.value) for c in choice)
        raise ValueError(f"{variable} must be one of {allowed}, got {value!r}") from None


_lock = threading.Lock()
_current = RoutingSettings.from_environment()


def current() -> RoutingSettings:
    return _current


def update(**changes) -> RoutingSettings:
    """Replace some settings (names of RoutingSettings' fields; policy and path also as their
    strings); returns the settings before the change."""
    global _current
    if "policy" in changes:
        changes["policy"] = _choice(Policy, "policy", changes["policy"])
    if "path" in changes:
        changes["path"] = _choice(Path, "path", changes["path"])
    with _lock:
        before = _current
        _current = dataclasses.replace(before, **changes)
    return before


def restore(settings: RoutingSettings) -> None:
    """Put back every setting of `settings` (what update() returned)."""
    update(**{field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)})


# ---------------------------------------------------------------------------------------
# The public switches
# ---------------------------------------------------------------------------------------


def enable() -> None:
    """Route eligible GEMMs of graphs compiled from now on through the kernel."""
    update(enabled=True)


def disable() -> None:
    """Leave every GEMM of graphs compiled from now on to Inductor."""
    update(enabled=False)


def is_enabled() -> bool:
    return _current.enabled


@contextlib.contextmanager
def routing(enabled: bool | None = None, *, policy: str | None = None, path: str | None = None,
            fuse_epilogues: bool | None = None):
    """Routing on or off (and optionally another policy, path or epilogue fusion) for graphs
    compiled inside the block; a lazily compiled backward compiles at .backward(): call that
    inside too."""
    changes = {name: value for name, value in
               (("enabled", enabled), ("policy", policy), ("path", path), ("fuse_epilogues", fuse_epilogues))
               if value is not None}
    before = update(**changes)
    try:
        yield
    finally:
        update(**{name: getattr(before, name) for name in changes})


def route_cpu(enabled: bool) -> None:
    """Also route CPU GEMMs: compiled code then calls the ops, which run the kernel through
    Triton's interpreter. Slow; for tests and demos on machines without a GPU. Every
    eligible CPU GEMM is routed whatever the policy (the interpreter has no speed to
    predict)."""
    update(cpu=bool(enabled))


def set_policy(policy: str) -> None:
    """"auto" (the default): route the eligible GEMMs the kernel is predicted to run at least
    as fast as Inductor's choice on an idle GPU (policy.py, from measurements on that GPU);
    "shared": those it runs within ~10% of cuBLAS alone, which win once other work holds SMs;
    "all": every eligible GEMM."""
    update(policy=policy)


def get_policy() -> str:
    return _current.policy.value


def batch_invariant(enabled: bool) -> None:
    """Batch-invariant numerics (also TRITONBLAS_OPS_BATCH_INVARIANT=1): every ws GEMM from
    now on, explicit or in graphs compiled from now on, computes each output element in an
    order that does not depend on the rows beside it: ws_mm(a[:m], b)[i] is bitwise equal to
    ws_mm(a, b)[i] for every m. Costs speed where M alone would pick a K split or the
    transposed decode path: decode, K-heavy and skinny shapes (benchmarks/RESULTS.md)."""
    update(batch_invariant=bool(enabled))


def is_batch_invariant() -> bool:
    return _current.batch_invariant


def fuse_epilogues(enabled: bool) -> None:
    """Epilogue fusion (also TRITONBLAS_OPS_FUSE_EPILOGUES=1) for graphs compiled from now on:
    a routed GEMM (mm, or addmm with its bias) whose only reader is a ReLU, GELU (erf or
    tanh) or SiLU becomes one torch.ops.tritonblas.ws_mm_act call, the activation applied
    in the kernel's epilogue; a GLU's act(gate) * up, and a backward's GELU or SiLU backward
    of a GEMM's output, one ws_mm_gated call (fusion.py). Off by default: on the H200 a fused
    op beats the GEMM and the pointwise kernel it removes, but a compiled model with its
    GEMMs fused is not yet faster than default Inductor (benchmarks/RESULTS.md)."""
    update(fuse_epilogues=bool(enabled))


def is_fusing_epilogues() -> bool:
    return _current.fuse_epilogues


def warp_specialize(enabled: bool) -> None:
    """The warp-specialized kernel (on by default; TRITONBLAS_OPS_WARP_SPECIALIZE=0 turns it
    off) for the launches from now on that it can take: Hopper (sm_90), bf16 or fp16,
    operands tensor descriptors can read, one of its tiles with no K split, work stealing
    (plan.warp_specialized_eligible); the ops' calls, eager or from compiled graphs' opaque
    form. Its loader warp claims and loads the next tile while the MMA warps run this one's
    epilogue; the results are the Triton kernel's bits. Every other launch, and every launch
    of compiled graphs' inline form (traced: no host descriptors), keeps the Triton kernel."""
    update(warp_specialize=bool(enabled))


def is_warp_specializing() -> bool:
    return _current.warp_specialize

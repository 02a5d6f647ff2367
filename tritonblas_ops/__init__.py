"""tritonblas_ops: a work-stealing persistent Triton GEMM as torch.ops.tritonblas.*"""

from tritonblas_ops import distributed as _distributed
from tritonblas_ops import lowering as _lowering
from tritonblas_ops import grouped, ops  # noqa: F401  (register torch.ops.tritonblas.*)
from tritonblas_ops.budget import LiveBudget, get_sm_budget, sm_budget
from tritonblas_ops.config import TileConfig
from tritonblas_ops.launch import is_checked, set_checked, ws_matmul
from tritonblas_ops.plan import Schedule
from tritonblas_ops.settings import (
    batch_invariant,
    disable,
    enable,
    fuse_epilogues,
    get_policy,
    is_batch_invariant,
    is_enabled,
    is_fusing_epilogues,
    is_warp_specializing,
    route_cpu,
    routing,
    set_policy,
    warp_specialize,
)

_lowering.install()  # torch.compile routes eligible GEMMs from here on (lowering.py)
_distributed.register()  # DTensor sharding rules for the ops (distributed.py)

__all__ = [
    "LiveBudget", "Schedule", "TileConfig", "batch_invariant", "disable", "enable", "fuse_epilogues",
    "get_policy", "get_sm_budget", "is_batch_invariant", "is_checked", "is_enabled", "is_fusing_epilogues",
    "is_warp_specializing", "route_cpu", "routing", "set_checked", "set_policy", "sm_budget", "warp_specialize",
    "ws_matmul",
]

"""tritonblas_ops: a work-stealing persistent Triton GEMM as torch.ops.tritonblas.*"""

from tritonblas_ops import distributed as _distributed
from tritonblas_ops import ops  # noqa: F401  (registers torch.ops.tritonblas.*)
from tritonblas_ops import routing as _routing
from tritonblas_ops.config import TileConfig
from tritonblas_ops.kernel import Schedule, ws_matmul
from tritonblas_ops.routing import disable, enable, get_policy, is_enabled, routing, set_policy

_routing.install()  # torch.compile routes eligible GEMMs from here on (routing.py)
_distributed.register()  # DTensor sharding rules for the ops (distributed.py)

__all__ = [
    "Schedule", "TileConfig", "disable", "enable", "get_policy", "is_enabled", "routing",
    "set_policy", "ws_matmul",
]

"""tritonblas_ops: a work-stealing persistent Triton GEMM as torch.ops.tritonblas.*"""

from tritonblas_ops import ops  # noqa: F401  (registers torch.ops.tritonblas.*)
from tritonblas_ops.config import TileConfig
from tritonblas_ops.kernel import Schedule, ws_matmul

__all__ = ["Schedule", "TileConfig", "ws_matmul"]

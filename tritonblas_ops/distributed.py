"""DTensor sharding rules for torch.ops.tritonblas.ws_mm / ws_addmm / ws_bmm.

With these rules the ops take DTensor operands (tensor parallelism): DTensor picks one of
the acceptable placements below, redistributes the inputs to it if needed, and runs the op
on each rank's local shards, so every rank's GEMM runs the work-stealing kernel.

The rules are those DTensor has for aten.mm / addmm / bmm (torch/distributed/tensor/_ops/
_matrix_ops.py), per mesh dimension; `register_sharding` expands them over all of a mesh's
dimensions. For (M, K) @ (K, N) -> (M, N), as [output, a, b]:

    Replicate, Replicate, Replicate   everything on every rank
    Shard(0),  Shard(0),  Replicate   rows of a (sequence or batch parallel)
    Shard(1),  Replicate, Shard(1)    columns of b (column-parallel weight)
    Partial,   Shard(1),  Shard(0)    K split (row-parallel weight): partial sums
    Partial,   Partial,   Replicate   the GEMM is linear in each operand
    Partial,   Replicate, Partial

ws_bmm adds its batch dimension (all three Shard(0)) and shifts the others by one.
ws_addmm's bias follows the output's placement through broadcasting, as aten.addmm's
does: a (N,) bias of a Shard(1) output is Shard(0), one broadcast along the sharded
dimension is Replicate, and with a Partial output the bias is Partial too. DTensor makes a
Replicate bias Partial by splitting its value over the ranks (the parts sum to the bias),
so the reduction that completes the output adds the bias exactly once.

Autograd needs nothing more: the ops' backward calls ws_mm / ws_bmm on DTensor gradients,
which these rules place too. Under torch.compile, DTensor runs its propagation while
AOTAutograd traces, and the graph holds the local GEMMs (aten ops on CPU, the kernel on a
GPU) with routing.py taking them from there.

`register()` runs at `import tritonblas_ops`; it is idempotent and does nothing where torch
is built without torch.distributed.
"""

import torch

from tritonblas_ops import ops  # noqa: F401  (defines the ops the rules are for)

_registered = False


def register() -> bool:
    """Register the rules for the three ops; returns whether DTensor has them now."""
    global _registered
    if _registered:
        return True
    if not torch.distributed.is_available():
        return False  # a torch built without distributed (USE_DISTRIBUTED=0): no DTensor
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ModuleNotFoundError:
        return False  # distributed is built but DTensor's modules are not: nothing to extend

    # The Partial reductions a GEMM is linear in; recent torch lists them on Partial.
    linear_reduce_ops = getattr(Partial, "LINEAR_REDUCE_OPS", ("sum", "avg"))

    def matmul_rules(batched: bool) -> list[tuple]:
        """[output, a, b] placements over one mesh dimension."""
        m = int(batched)  # a is ([B,] M, K), b is ([B,] K, N), the output ([B,] M, N)
        rules = [
            (Replicate(), Replicate(), Replicate()),
            (Shard(m), Shard(m), Replicate()),
            (Shard(m + 1), Replicate(), Shard(m + 1)),
            (Partial(), Shard(m + 1), Shard(m)),
        ]
        if batched:
            rules.append((Shard(0), Shard(0), Shard(0)))
        for reduce_op in linear_reduce_ops:
            rules.append((Partial(reduce_op), Partial(reduce_op), Replicate()))
            rules.append((Partial(reduce_op), Replicate(), Partial(reduce_op)))
        return rules

    def as_sharding(rules) -> list[tuple[list, list]]:
        return [([out], list(inputs)) for out, *inputs in rules]

    def bias_placement(out, bias_shape):
        """The bias's placement for an output placement, through broadcasting to (M, N)."""
        if not isinstance(out, Shard):
            return out  # Replicate stays Replicate, Partial stays Partial
        dim = out.dim - (2 - len(bias_shape))  # the bias's dimension under out.dim
        if dim < 0 or bias_shape[dim] == 1:
            return Replicate()  # broadcast along the sharded dimension
        return Shard(dim)

    @register_sharding(torch.ops.tritonblas.ws_mm.default)
    def _ws_mm_sharding(a, b):
        return as_sharding(matmul_rules(batched=False))

    @register_sharding(torch.ops.tritonblas.ws_bmm.default)
    def _ws_bmm_sharding(a, b):
        return as_sharding(matmul_rules(batched=True))

    @register_sharding(torch.ops.tritonblas.ws_addmm.default)
    def _ws_addmm_sharding(bias, a, b, *, beta=1.0, alpha=1.0):
        return [
            ([out], [bias_placement(out, bias.shape), a_placement, b_placement])
            for out, a_placement, b_placement in matmul_rules(batched=False)
        ]

    _registered = True
    return True

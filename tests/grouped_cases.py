"""Grouped GEMM cases for the tests: uneven group sizes, operands with the groups along a
ragged dimension, and torch._grouped_mm's result in float64."""

import torch

from tritonblas_ops import grouped


def group_sizes(total: int, groups: int, generator) -> list[int]:
    """Uneven sizes summing to at most `total`: some empty, one holding most, a tail left."""
    weights = torch.rand(groups, generator=generator) ** 3
    weights[torch.randperm(groups, generator=generator)[: max(1, groups // 4)]] = 0  # empty groups
    sizes = (weights / weights.sum() * total * 0.9).floor().long()
    return sizes.tolist()


def offsets(sizes) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def reference(a, b, offs) -> torch.Tensor:
    """torch._grouped_mm's result in float64, group by group, with zeros where no group is."""
    ragged = grouped.ragged_dim(a, b)
    a, b = a.double(), b.double()
    if ragged is None:
        return a @ b
    ends = offs.tolist()
    begins = [0, *ends[:-1]]
    if ragged == "m":
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (lo, hi) in enumerate(zip(begins, ends)):
            out[lo:hi] = a[lo:hi] @ b[g]
    elif ragged == "n":
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (lo, hi) in enumerate(zip(begins, ends)):
            out[:, lo:hi] = a[g] @ b[:, lo:hi]
    else:
        out = torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(begins, ends)])
    return out


def operands(ragged: str, sizes, m: int, n: int, k: int, dtype, device="cpu", generator=None):
    """(mat_a, mat_b, offs) with the groups of `sizes` along the ragged dimension, whose
    extent is the sizes' sum plus a few rows no group holds."""
    groups, extent = len(sizes), sum(sizes) + 5
    shapes = {"m": ((extent, k), (groups, k, n)), "n": ((groups, m, k), (k, extent)),
              "k": ((m, extent), (extent, n))}[ragged]
    a, b = (torch.randn(*shape, generator=generator).to(dtype=dtype, device=device) for shape in shapes)
    return a, b, offsets(sizes).to(device)

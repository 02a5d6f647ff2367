"""The README's first command ends in `python -m tritonblas_ops.demo`: it must work here."""

import re

import torch

import tritonblas_ops
from tritonblas_ops import demo


def test_demo_runs_the_kernel_eagerly_and_compiled(capsys):
    torch._dynamo.reset()
    try:
        demo.main()
    finally:
        tritonblas_ops.route_cpu(False)
        torch._dynamo.reset()
    out = capsys.readouterr().out
    error = float(re.search(r"relative error against float64 ([\d.e+-]+)", out).group(1))
    assert error < 1e-5 and "bitwise reproducible: True" in out, out
    assert "2 GEMMs routed to the kernel forward, 3 backward" in out, out

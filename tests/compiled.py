"""Compiling under routing in tests: what the generated code routed, the routing state each
test starts from (fresh_state, autouse where imported) and CPU routing (cpu_routing), and the
inline path's code for a stand-in CUDA target (generated_code_only). Shared by
test_lowering.py and test_fusion.py."""

import re
from unittest import mock

import pytest
import torch
import triton
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import run_and_get_code

import tritonblas_ops
from tritonblas_ops import settings
from tritonblas_ops.settings import Policy, RoutingSettings

OPAQUE_CALL = re.compile(r"torch\.ops\.tritonblas\.(ws_\w+)\.default\(")
INLINE_CALL = re.compile(r"\b(ws_matmul_kernel)_\d+\.run\(")


def routed_calls(code: str) -> list[str]:
    """The routed GEMMs a generated module calls: op names (opaque) or the kernel's (inline)."""
    return OPAQUE_CALL.findall(code) + INLINE_CALL.findall(code)


def compile_and_run(fn, *args, **compile_kwargs):
    """fn compiled by Inductor, run once: (output, the generated code)."""
    out, codes = run_and_get_code(torch.compile(fn, **compile_kwargs), *args)
    return out, "\n".join(codes)


def backward_code(out) -> str:
    _, codes = run_and_get_code(lambda: out.sum().backward())
    return "\n".join(codes)


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts from the default routing settings under policy "all" (every
    eligible GEMM routed; CPU tensors ineligible) and ends with them restored, with the
    compiled-code caches off (a hit would skip the lowering under test) and no compiled
    frames left over."""
    before = settings.current()
    settings.restore(RoutingSettings(policy=Policy.ALL))
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch._dynamo.reset()
            yield
    finally:
        settings.restore(before)
        torch._dynamo.reset()


@pytest.fixture
def cpu_routing():
    tritonblas_ops.route_cpu(True)


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)


class _CodeGenerated(Exception):
    pass


def generated_code_only(fn, *args, **compile_kwargs) -> str:
    """Inductor's generated module for fn(*args), for a stand-in CUDA target (Hopper),
    never compiled nor run: the inline kernel's launch needs a real device."""

    class FakeCudaDriver:
        def get_current_target(self):
            from triton.backends.compiler import GPUTarget

            return GPUTarget("cuda", 90, 32)

    codes = []

    def codegen_only(graph):
        codes.append(graph.codegen()[0].value)
        raise _CodeGenerated

    fake_driver = property(lambda self: FakeCudaDriver())
    with mock.patch.object(type(triton.runtime.driver), "active", fake_driver), \
            mock.patch.object(GraphLowering, "compile_to_module", codegen_only), \
            pytest.raises(Exception) as raised:
        torch.compile(fn, **compile_kwargs)(*args)
    assert codes, f"no code was generated: {raised.value!r}"
    return codes[0]

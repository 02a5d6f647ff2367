"""torch.compile routing (tritonblas_ops/lowering.py, settings.py): which GEMMs compiled code
sends to the kernel.

On the CPU, the `cpu_routing` fixture makes CPU tensors eligible: compiled code then calls the
opaque ops, which run the kernel through Triton's interpreter (small shapes only). The inline
path's code generation is checked against a stand-in CUDA target, without running anything.
The `gpu` tests run both paths for real.
"""

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from unittest import mock

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import tritonblas_ops
from tritonblas_ops import _compat, settings
from tritonblas_ops import device as devices
from tritonblas_ops import lowering as R
from tritonblas_ops import plan as plan_module
from tritonblas_ops.config import TileConfig
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, rel_error
from tiles import m_dependent_tiles  # noqa: F401  (a fixture)
from compiled import (  # noqa: F401  (fresh_state and cpu_routing: fixtures)
    backward_code, compile_and_run, cpu_routing, fresh_state, generated_code_only, randn, routed_calls)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------
# Every spelling of a GEMM reaches the kernel
# ---------------------------------------------------------------------------------------

# name: (function, its inputs, the op the compiled code must call)
SPELLINGS = {
    "operator @": (lambda a, b: a @ b, lambda: (randn(8, 12), randn(12, 16)), "ws_mm"),
    "torch.matmul 2-D": (torch.matmul, lambda: (randn(8, 12), randn(12, 16)), "ws_mm"),
    "torch.matmul 3-D @ 2-D": (torch.matmul, lambda: (randn(2, 4, 12), randn(12, 16)), "ws_mm"),
    "torch.matmul 3-D": (torch.matmul, lambda: (randn(2, 8, 12), randn(2, 12, 16)), "ws_bmm"),
    "torch.bmm": (torch.bmm, lambda: (randn(2, 8, 12), randn(2, 12, 16)), "ws_bmm"),
    "F.linear": (F.linear, lambda: (randn(8, 12), randn(16, 12)), "ws_mm"),
    "F.linear with bias": (F.linear, lambda: (randn(8, 12), randn(16, 12), randn(16)), "ws_addmm"),
    "F.linear with bias, 3-D input": (
        F.linear, lambda: (randn(2, 4, 12), randn(16, 12), randn(16)), "ws_addmm"),
    "torch.addmm": (torch.addmm, lambda: (randn(8, 16), randn(8, 12), randn(12, 16)), "ws_addmm"),
    "an operand with no unit stride": (
        lambda a, b: a[:, ::2] @ b, lambda: (randn(8, 24), randn(12, 16)), "ws_mm"),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_is_routed(spelling, cpu_routing):
    fn, make_inputs, op = SPELLINGS[spelling]
    inputs = make_inputs()
    out, code = compile_and_run(fn, *inputs)
    assert routed_calls(code) == [op]
    assert_matches(out, fn(*inputs), REL_TOLERANCE[torch.float32])


def test_addmm_keeps_beta_and_alpha(cpu_routing):
    def fn(bias, a, b):
        return torch.addmm(bias, a, b, beta=0.5, alpha=2.0)

    inputs = randn(16), randn(8, 12), randn(12, 16)
    out, code = compile_and_run(fn, *inputs)
    FileCheck().check("torch.ops.tritonblas.ws_addmm.default(").check("beta=0.5, alpha=2.0").run(code)
    assert_matches(out, fn(*inputs), REL_TOLERANCE[torch.float32])


def test_linear_forward_and_backward_are_routed(cpu_routing):
    """The backward compiles lazily, at the first .backward(): routing reaches it too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 16)
    x = randn(8, 12, requires_grad=True)
    out, forward_code = compile_and_run(linear, x)
    backward = backward_code(out)
    assert routed_calls(forward_code) == ["ws_addmm"]
    assert routed_calls(backward) == ["ws_mm", "ws_mm"]  # grad of the input, of the weight

    grads = [x.grad, linear.weight.grad, linear.bias.grad]
    x.grad = linear.weight.grad = linear.bias.grad = None
    eager = linear(x)
    eager.sum().backward()
    assert_matches(out, eager, REL_TOLERANCE[torch.float32])
    for grad, eager_grad in zip(grads, [x.grad, linear.weight.grad, linear.bias.grad]):
        assert_matches(grad, eager_grad, REL_TOLERANCE[torch.float32])


class RoutedGraphText(expecttest.TestCase):
    def test_linear(self):
        """The GEMM calls of a compiled Linear's forward and backward, as generated (the
        same text on torch 2.11, 2.13 and 2.14 once Inductor's buffer numbers, which differ
        between them, are left out)."""
        before = settings.update(cpu=True)
        try:
            linear = torch.nn.Linear(12, 16)
            out, forward_code = compile_and_run(linear, randn(8, 12, requires_grad=True))
            code = forward_code + "\n" + backward_code(out)
        finally:
            settings.restore(before)
        calls = "\n".join(re.sub(r"\bbuf\d+\b", "buf", line.strip())
                          for line in code.splitlines() if "tritonblas" in line)
        self.assertExpectedInline(calls, """\
buf = torch.ops.tritonblas.ws_addmm.default(primals_2, primals_3, reinterpret_tensor(primals_1, (12, 16), (1, 12), 0), beta=1.0, alpha=1.0)
buf = torch.ops.tritonblas.ws_mm.default(tangents_1, primals_1)
buf = torch.ops.tritonblas.ws_mm.default(reinterpret_tensor(tangents_1, (16, 8), (1, 16), 0), primals_3)""")


# ---------------------------------------------------------------------------------------
# What keeps Inductor's own path
# ---------------------------------------------------------------------------------------


def test_routing_off_in_context_manager(cpu_routing):
    with tritonblas_ops.routing(False):
        assert not tritonblas_ops.is_enabled()
        _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert tritonblas_ops.is_enabled()
    assert routed_calls(code) == []


def test_disable_and_enable(cpu_routing):
    tritonblas_ops.disable()
    _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert routed_calls(code) == []
    tritonblas_ops.enable()
    _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert routed_calls(code) == ["ws_mm"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_unsupported_dtypes_keep_inductor(dtype, cpu_routing):
    a, b = torch.ones(8, 12, dtype=dtype), torch.ones(12, 16, dtype=dtype)
    out, code = compile_and_run(torch.mm, a, b)
    assert routed_calls(code) == []
    assert torch.equal(out, torch.mm(a, b))


def test_cpu_tensors_are_not_eligible_by_default():
    _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert routed_calls(code) == []


def test_shared_policy_thresholds():
    """The "shared" rule against the H200 rows it was read from (benchmarks/RESULTS.md)."""
    assert R._shared_routes(1, 8192, 8192, 8192)
    assert R._shared_routes(1, 4864, 8192, 4160)
    assert R._shared_routes(1, 4096, 14336, 4096)
    assert R._shared_routes(1, 2048, 4096, 14336)
    assert not R._shared_routes(1, 1000, 1000, 1000)  # launch-bound
    assert not R._shared_routes(1, 2048, 2048, 2048)  # host-bound
    assert not R._shared_routes(1, 128, 8192, 8192)  # skinny
    assert not R._shared_routes(1, 1024, 1024, 16384)  # K-heavy, fewer tiles than SMs
    assert not R._shared_routes(1, 3000, 5000, 2000)  # N not a multiple of 16


def test_shared_policy_leaves_small_gemms_to_inductor(cpu_routing):
    tritonblas_ops.set_policy("shared")
    assert tritonblas_ops.get_policy() == "shared"
    _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert routed_calls(code) == []
    with pytest.raises(ValueError):
        tritonblas_ops.set_policy("fastest")


@pytest.mark.parametrize("spelling,enabled", [("0", False), ("false", False), ("Off", False),
                                              ("no", False), ("1", True), ("yes", True), ("ON", True)])
def test_environment_is_read_at_import(spelling, enabled):
    env = {**os.environ, "TRITONBLAS_OPS_ROUTING": spelling, "TRITONBLAS_OPS_POLICY": "auto",
           "TRITONBLAS_OPS_ROUTING_PATH": "inline", "PYTHONPATH": REPO}
    script = ("import tritonblas_ops; from tritonblas_ops import settings; "
              "print(tritonblas_ops.is_enabled(), tritonblas_ops.get_policy(), settings.current().path.value)")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == [str(enabled), "auto", "inline"]


def test_an_unknown_routing_value_is_refused_at_import():
    env = {**os.environ, "TRITONBLAS_OPS_ROUTING": "maybe", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", "import tritonblas_ops"], env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "TRITONBLAS_OPS_ROUTING must be one of 1, true, on, yes, 0, false, off, no, got 'maybe'" in out.stderr


# ---------------------------------------------------------------------------------------
# No graph breaks, no recompiles, dynamic shapes
# ---------------------------------------------------------------------------------------


def test_no_graph_breaks_or_recompiles(cpu_routing):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    x = randn(8, 12)
    for _ in range(2):
        assert_matches(compiled(x), model(x), REL_TOLERANCE[torch.float32])
    assert counter.frame_count == 1
    assert torch._dynamo.utils.counters["graph_break"] == {}


@torch.no_grad()
def test_dynamic_shapes_compile_once(cpu_routing):
    """Routing decides from size hints and adds no guard: one graph serves every M."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 16)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(linear, backend=counter, dynamic=True)
    x = randn(8, 12)
    out, codes = run_and_get_code(compiled, x)
    assert routed_calls("\n".join(codes)) == ["ws_addmm"]
    assert_matches(out, linear(x), REL_TOLERANCE[torch.float32])
    for m in (10, 13):
        x = randn(m, 12)
        assert_matches(compiled(x), linear(x), REL_TOLERANCE[torch.float32])
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------
# Caches: never code compiled under another routing state; hits when nothing changed
# ---------------------------------------------------------------------------------------


def test_cache_key_encodes_the_routing_settings():
    key = R.cache_key_pass()
    assert key in _compat.post_grad_post_passes()
    routed = key.uuid()
    assert key.uuid() == routed
    for change in ({"enabled": False}, {"policy": "auto"}, {"path": "inline"}, {"cpu": True},
                   {"fuse_epilogues": True}, {"batch_invariant": True}):
        before = settings.update(**change)
        assert key.uuid() != routed, change
        settings.restore(before)
        assert key.uuid() == routed


class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass"


def test_user_pass_is_chained_not_clobbered(cpu_routing):
    user_pass = UserPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass):
        _compat.append_post_grad_post_pass(R.cache_key_pass())
        assert _compat.post_grad_post_passes() == (user_pass, R.cache_key_pass())
        _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert user_pass.calls == 1
    assert routed_calls(code) == ["ws_mm"]


def test_a_replaced_key_pass_stops_routing_loudly(cpu_routing):
    R._warn_cache_key_missing.cache_clear()
    with torch._inductor.config.patch(post_grad_custom_post_pass=UserPass()):
        with pytest.warns(UserWarning, match="cache-key pass"):
            _, code = compile_and_run(torch.mm, randn(8, 12), randn(12, 16))
    assert routed_calls(code) == []


CACHE_RUN = textwrap.dedent("""
    import importlib, json, sys
    import torch
    import tritonblas_ops
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    tritonblas_ops.route_cpu(True)
    if sys.argv[1] == "off":
        tritonblas_ops.disable()
    _, codes = run_and_get_code(torch.compile(torch.mm), torch.randn(8, 12), torch.randn(12, 16))
    print(json.dumps({
        "routed": "tritonblas.ws_mm" in "".join(codes),
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
    }))
""")


def test_caches_across_processes(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}

    def run(state):
        out = subprocess.run([sys.executable, "-c", CACHE_RUN, state], env=env,
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.splitlines()[-1])
        return result["routed"], result["fx_hits"] + result["aot_hits"] > 0

    assert run("on") == (True, False)
    assert run("off") == (False, False)  # not the routed code the warm cache holds
    assert run("on") == (True, True)  # the same state hits


# ---------------------------------------------------------------------------------------
# The "tritonblas" backend
# ---------------------------------------------------------------------------------------


def test_backend_routes_even_when_disabled(cpu_routing):
    """Forced on for its compile, the lazily compiled backward included."""
    tritonblas_ops.disable()
    linear = torch.nn.Linear(12, 16)
    out, forward_code = compile_and_run(linear, randn(8, 12, requires_grad=True),
                                        backend=R.tritonblas_backend)
    assert routed_calls(forward_code) == ["ws_addmm"]
    assert routed_calls(backward_code(out)) == ["ws_mm", "ws_mm"]
    assert not tritonblas_ops.is_enabled()


def _entry_point_installed() -> bool:
    return "tritonblas" in importlib.metadata.entry_points(group="torch_dynamo_backends").names


@pytest.mark.skipif(not _entry_point_installed(),
                    reason="package metadata without the entry point (pip install -e .)")
def test_backend_entry_point():
    assert "tritonblas" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("tritonblas") is R.tritonblas_backend


# ---------------------------------------------------------------------------------------
# The inline path's generated code, against a stand-in CUDA target (nothing runs)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, True])
def test_inline_code_generation(dynamic):
    """The inline path's code for an addmm, a bmm and two mm, one of whose operands has no
    unit stride. Triton compiles the kernel for it (to find what it writes) right after the
    interpreter ran it in this process: the interpreter must leave triton.language as it was."""
    from torch._higher_order_ops import triton_kernel_wrap

    from tritonblas_ops import ws_matmul

    ws_matmul(randn(8, 8), randn(8, 8))  # an interpreted launch first
    settings.update(path="inline", cpu=True, inline_cpu=True)

    def fn(x, w, bias, y, z):
        linear = F.linear(x, w, bias).relu() @ y  # an addmm, an mm
        return linear, torch.bmm(x.view(2, 4, 12), x.view(2, 12, 4)), z[:, ::2] @ y  # a bmm, an mm

    with torch.no_grad(), mock.patch.object(triton_kernel_wrap.log, "warning") as warning:
        code = generated_code_only(fn, randn(8, 12), randn(16, 12), randn(16), randn(16, 4),
                                   randn(8, 32), dynamic=dynamic)
    assert routed_calls(code) == ["ws_matmul_kernel"] * 4
    assert "def ws_matmul_kernel(" in code
    # Triton's TTIR analysis found what the kernel writes. Had it failed, Inductor would
    # assume every argument written (what host-built descriptors did under torch 2.11).
    assert warning.call_count == 0


def planned_tma(code: str) -> list[tuple[bool, bool]]:
    """(USE_TMA, TMA_STORE) of each inline kernel a generated module defines."""
    loads = re.findall(r"'USE_TMA': (True|False)", code)
    stores = re.findall(r"'TMA_STORE': (True|False)", code)
    return [(load == "True", store == "True") for load, store in zip(loads, stores)]


def test_inline_uses_tma_where_inductor_keeps_operands_aligned():
    """Tensor descriptors need 16-byte aligned bases: buffers Inductor allocates are, and so
    are views of them at a multiple of 16 bytes; a view one element in is not (pointer
    loads). (On the CPU Inductor counts graph inputs unaligned: it checks only GPU inputs'
    alignment at run time, tested on the GPU; so here the operands are intermediates.)"""
    settings.update(path="inline", cpu=True, inline_cpu=True)

    def fn(x, y):
        return (x + 1) @ (y + 1), (x + 2)[:, 1:] @ (y + 2)[1:], (x + 3)[:, 4:] @ (y + 3)[4:]

    with torch.no_grad(), mock.patch.object(devices, "has_tma", lambda device: True):
        code = generated_code_only(fn, randn(16, 32), randn(32, 16))
    assert planned_tma(code) == [(True, True), (False, False), (True, True)]


def inline_launches(code: str) -> list[list[str]]:
    """The arguments of each inline kernel launch in a generated module, in order, a view of
    a buffer (reinterpret_tensor) named by its buffer."""
    views = re.sub(r"reinterpret_tensor\((\w+), \([^)]*\), \([^)]*\), \w+\)", r"\1", code)
    return [args.split(", ") for args in re.findall(r"\bws_matmul_kernel_\d+\.run\(([^)]*)\)", views)]


@pytest.mark.parametrize("graphed", [False, True])
def test_inline_operand_descriptors_built_on_the_host_under_cuda_graphs(graphed):
    """Under CUDA graphs (mode="reduce-overhead") the generated code builds A's and B's
    tensor descriptors on the host, laid out as the eager launch's (a column-major operand
    as its transpose) and passes them to the launch, so the programs need not make them;
    C's stays the programs' (Inductor must see the store to keep the launch). Without CUDA
    graphs the programs make all three (no host time per call)."""
    settings.update(path="inline", cpu=True, inline_cpu=True)

    def fn(x, y):
        return (x + 1) @ (y + 1).T  # B column-major

    if torch.__version__ >= (2, 13):  # (torch 2.11's Inductor cannot analyse such a kernel)
        assert _compat.HOST_DESCRIPTOR_ARGUMENTS
    options = {"triton.cudagraphs": graphed}
    with torch.no_grad(), mock.patch.object(devices, "has_tma", lambda device: True):
        code = generated_code_only(fn, randn(64, 32), randn(48, 32), options=options)
    assert planned_tma(code) == [(True, True)]
    graphed = graphed and _compat.HOST_DESCRIPTOR_ARGUMENTS
    built = re.findall(r"(\w+) = triton\.tools\.tensor_descriptor\.TensorDescriptor\.from_tensor\("
                       r"reinterpret_tensor\(\w+, \(([\d, ]+)\), \([\d, ]+\), 0\), \(([\d, ]+)\)\)", code)
    launch, = inline_launches(code)
    descriptor_args = launch[8:11]  # a_desc, b_desc, c_desc (-1: None)
    if not graphed:
        assert built == [] and descriptor_args == ["-1", "-1", "-1"]
        return
    # (batch, rows, columns) with one-batch boxes: A (64, 32) as it is, B = (y + 1).T as (48, 32)
    assert [shape for _, shape, _ in built] == ["1, 64, 32", "1, 48, 32"]
    assert all(box.startswith("1, ") for _, _, box in built)
    assert descriptor_args == [built[0][0], built[1][0], "-1"]


def test_inline_gemms_of_a_graph_share_one_counter_buffer(m_dependent_tiles):
    """Every launch leaves its counters at zero, so a graph's routed GEMMs take one zeroed
    buffer (one fill per graph, not per GEMM), in program order; a split-K GEMM, which needs
    more counters (its tiles' arrivals), starts a larger one that later GEMMs share."""
    settings.update(path="inline", cpu=True, inline_cpu=True)

    def fn(x, w, v):
        h = (x @ w).relu()  # 40 rows: one K slice
        return h @ v, h[:16] @ v, (h @ v).relu() @ w  # 16 rows: a K split of 2

    with torch.no_grad():
        code = generated_code_only(fn, randn(40, 32), randn(32, 32), randn(32, 32))
    counters = [args[4] for args in inline_launches(code)]  # the kernel's fifth argument
    assert len(counters) == 5
    first, split_k = counters[0], counters[2]
    assert counters == [first, first, split_k, split_k, split_k] and split_k != first
    assert len(re.findall(r"torch\.int32\)", code)) == 2  # the two counter buffers


def test_inline_split_tail(monkeypatch):
    """A split tail in the inline form: the plan's whole tiles are the launch's argument and
    the partials buffer holds the split tiles' slices only (on the interpreter's 4 "SMs",
    5 x 6 tiles: 28 whole, 2 split in 3 slices of 16 x 16)."""
    config = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, split_k=3, split_tail=True)
    monkeypatch.setattr(plan_module, "select_config", lambda *args, **kwargs: config)
    settings.update(path="inline", cpu=True, inline_cpu=True)
    with torch.no_grad():
        code = generated_code_only(lambda x, w: x @ w, randn(70, 100), randn(100, 90))
    arguments = inline_launches(code)[0]
    names = ws_matmul_kernel.arg_names
    assert arguments[names.index("whole_tiles")] == "28"
    assert re.search(r"empty_strided\w*\(\(1536, \), \(1, \), torch\.float32\)", code)


def test_inline_without_a_product_launches_nothing():
    """alpha = 0 (and K = 0): as the op, beta * bias, no kernel launched."""
    settings.update(path="inline", cpu=True, inline_cpu=True)
    with torch.no_grad():
        code = generated_code_only(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=0.0),
                                   randn(16), randn(8, 12), randn(12, 16))
    assert routed_calls(code) == []


# ---------------------------------------------------------------------------------------
# GPU: both paths for real
# ---------------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def gpu_case(case: str, dtype):
    """(function, inputs, the routed calls of its forward): ragged M, N, K on purpose."""
    a = randn(257, 200, dtype=dtype, device="cuda")
    if case == "mm":
        return torch.mm, (a, randn(200, 136, dtype=dtype, device="cuda")), ["ws_mm"]
    if case == "addmm":
        inputs = randn(136, dtype=dtype, device="cuda"), a, randn(200, 136, dtype=dtype, device="cuda")
        return (lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0)), inputs, ["ws_addmm"]
    batched = (randn(3, 257, 200, dtype=dtype, device="cuda"),
               randn(3, 200, 136, dtype=dtype, device="cuda"))
    return torch.bmm, batched, ["ws_bmm"]


def expected_calls(calls: list[str], path: str) -> list[str]:
    return calls if path == "opaque" else ["ws_matmul_kernel"] * len(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["opaque", "inline"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", ["mm", "addmm", "bmm"])
def test_gpu_gemms_are_routed(case, dtype, path):
    settings.update(path=path)
    fn, inputs, calls = gpu_case(case, dtype)
    out, code = compile_and_run(fn, *inputs)
    assert routed_calls(code) == expected_calls(calls, path)
    ref = fn(*[t.double() for t in inputs])
    assert_matches(out, ref, REL_TOLERANCE[dtype])


# (M, N, K, beta, alpha): ragged; an alpha not exact in fp32 (the inline kernel gets it as
# fp64 and rounds it); beta 0 (the bias ignored, NaN included); alpha 0 (no product);
# split-K; a decode shape run transposed.
INLINE_CASES = {
    "ragged": (257, 136, 200, 0.5, 0.1),
    "beta 0": (1000, 700, 300, 0.0, 2.0),
    "alpha 0": (1000, 700, 300, 0.5, 0.0),
    "split-K": (256, 512, 32768, 1.0, 1.0),
    "decode": (5, 4000, 4096, 2.0, 1.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", list(INLINE_CASES))
def test_gpu_inline_is_bitwise_the_op(case, dtype):
    """The inline kernel runs the eager op's plan: the same bits as the op."""
    m, n, k, beta, alpha = INLINE_CASES[case]
    settings.update(path="inline")
    bias = randn(n, dtype=dtype, device="cuda")
    if beta == 0:
        bias[3] = float("nan")  # ignored
    a, b = randn(m, k, dtype=dtype, device="cuda"), randn(k, n, dtype=dtype, device="cuda")

    def fn(c, x, y):
        return torch.addmm(c, x, y, beta=beta, alpha=alpha)

    out, code = compile_and_run(fn, bias, a, b)
    assert routed_calls(code) == ([] if alpha == 0 else ["ws_matmul_kernel"])
    want = torch.ops.tritonblas.ws_addmm(bias, a, b, beta=beta, alpha=alpha)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_inline_gemms_sharing_counters_are_bitwise_the_op():
    """One graph: GEMMs of one K slice, a split-K one (its arrivals need a larger counter
    buffer), and more after it on that buffer: each left the counters at zero for the next."""
    settings.update(path="inline")
    x, w = randn(256, 32768, dtype=torch.bfloat16, device="cuda"), randn(32768, 512, dtype=torch.bfloat16, device="cuda")
    v = randn(512, 512, dtype=torch.bfloat16, device="cuda")

    def fn(x, w, v):
        h = x[:, :512] @ v
        k_heavy = x @ w
        return h, k_heavy, k_heavy @ v, (h @ v) @ v

    outs, code = compile_and_run(fn, x, w, v)
    assert routed_calls(code) == ["ws_matmul_kernel"] * 5
    mm = torch.ops.tritonblas.ws_mm
    h = mm(x[:, :512], v)
    wants = [h, mm(x, w), mm(mm(x, w), v), mm(mm(h, v), v)]
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_inline_under_cuda_graphs_is_bitwise_the_op():
    """mode="reduce-overhead": the generated code builds A's and B's descriptors on the host
    where Inductor can analyse such a kernel (torch 2.13+; a Linear's weight column-major, a
    decode GEMM swapped), the graph replays them on new inputs, and every output is the
    op's bits."""
    settings.update(path="inline")
    w, v = randn(2048, 4096, dtype=torch.bfloat16, device="cuda"), randn(2048, 512, dtype=torch.bfloat16, device="cuda")

    def fn(x, d):
        return F.linear(x, w), F.linear(d, w), x[:, :2048] @ v

    compiled = torch.compile(fn, mode="reduce-overhead")
    for step in range(3):  # warmup, recording, replay
        x, d = randn(1000, 4096, dtype=torch.bfloat16, device="cuda"), randn(5, 4096, dtype=torch.bfloat16, device="cuda")
        outs, codes = run_and_get_code(compiled, x, d) if step == 0 else (compiled(x, d), None)
        if codes is not None:
            tma_launches = [load for load, _ in planned_tma(codes[0]) if load]
            per_launch = 2 if _compat.HOST_DESCRIPTOR_ARGUMENTS else 0
            assert tma_launches and len(re.findall(r"TensorDescriptor\.from_tensor\(", codes[0])) == per_launch * len(tma_launches)
        wants = (torch.ops.tritonblas.ws_mm(x, w.T), torch.ops.tritonblas.ws_mm(d, w.T),
                 torch.ops.tritonblas.ws_mm(x[:, :2048], v))
        for out, want in zip(outs, wants):
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_inline_tma_and_a_misaligned_input():
    """Compiled for aligned inputs, the inline kernel reads them with tensor descriptors;
    called later with an input one element off alignment, Inductor copies it first (its
    run-time check of GPU inputs), and the result is still the op's."""
    settings.update(path="inline")
    a, b = randn(300, 256, dtype=torch.bfloat16, device="cuda"), randn(256, 200, dtype=torch.bfloat16, device="cuda")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(torch.mm, backend=counter)
    out, codes = run_and_get_code(compiled, a, b)  # resets dynamo first: compiled once, here
    assert planned_tma("\n".join(codes)) == [(True, True)]
    assert torch.equal(out, torch.ops.tritonblas.ws_mm(a, b))

    storage = randn(300 * 256 + 1, dtype=torch.bfloat16, device="cuda")
    shifted = storage[1:].view(300, 256)
    assert shifted.data_ptr() % 16 != 0
    for x in (a, shifted):
        torch.testing.assert_close(compiled(x, b), torch.ops.tritonblas.ws_mm(x, b), rtol=0, atol=0)
    assert counter.frame_count == 1  # the shifted input ran the aligned compile


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["opaque", "inline"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_linear_forward_and_backward(dtype, path):
    settings.update(path=path)
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 136, device="cuda", dtype=dtype)
    x = randn(4, 65, 200, dtype=dtype, device="cuda", requires_grad=True)
    out, forward_code = compile_and_run(linear, x)
    backward = backward_code(out)
    assert routed_calls(forward_code) == expected_calls(["ws_addmm"], path)
    assert routed_calls(backward) == expected_calls(["ws_mm", "ws_mm"], path)

    grads = [x.grad, linear.weight.grad]
    x_ref = x.detach().double().requires_grad_()
    weight_ref = linear.weight.detach().double().requires_grad_()
    out_ref = F.linear(x_ref, weight_ref, linear.bias.detach().double())
    out_ref.sum().backward()
    assert_matches(out, out_ref, REL_TOLERANCE[dtype])
    for grad, ref in zip(grads, [x_ref.grad, weight_ref.grad]):
        assert_matches(grad, ref, REL_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["opaque", "inline"])
def test_gpu_llama_block_is_fully_routed(path):
    """The small Llama block of benchmarks/models.py (run from the repository root: python -m
    pytest): its seven projections (q, k, v, o, gate, up, down) routed, two GEMMs each in
    the backward, none left to cuBLAS."""
    from benchmarks.models import MODELS, LlamaBlock

    settings.update(path=path)
    shape = MODELS["llama_small"]
    torch.manual_seed(0)
    block = LlamaBlock(shape).cuda().to(torch.bfloat16)
    x = randn(shape.batch, shape.seq, shape.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    out, forward_code = compile_and_run(block, x)
    backward = backward_code(out)
    for code, gemms in ((forward_code, 7), (backward, 14)):
        assert len(routed_calls(code)) == gemms
        assert not re.search(r"extern_kernels\.(mm|addmm|bmm)\(", code)

    # The bf16 block rounds at every op, so hold the routed block to eager bf16's own
    # distance from an fp32 run of the same weights: at most twice it (plus a floor).
    routed = [out, x.grad] + [p.grad for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    eager_out = block(x)
    eager_out.sum().backward()
    eager = [eager_out, x.grad] + [p.grad for p in block.parameters()]
    block32 = LlamaBlock(shape).cuda()
    block32.load_state_dict({name: p.float() for name, p in block.state_dict().items()})
    x32 = x.detach().float().requires_grad_()
    out32 = block32(x32)
    out32.sum().backward()
    fp32 = [out32, x32.grad] + [p.grad for p in block32.parameters()]
    for got, eager_bf16, ref in zip(routed, eager, fp32):
        assert rel_error(got, ref) <= 2 * rel_error(eager_bf16, ref) + 1e-3


# ---------------------------------------------------------------------------------------
# Batch-invariant numerics, compiled
# ---------------------------------------------------------------------------------------


def test_batch_invariant_compiled_rows_do_not_depend_on_the_batch(cpu_routing, m_dependent_tiles):
    """A routed GEMM compiled for M rows gives each row the bits the full batch's compile
    gives it (the op call: its plan at run time), and the inline kernel is planned with the
    same tile and K chunks for every M, transposed for the fewest rows, split into units, or
    not, or a split tail (code generation only, on the CPU)."""
    tritonblas_ops.batch_invariant(True)
    x, w = randn(40, 96), randn(24, 96)
    linear = torch.compile(lambda x: F.linear(x, w), dynamic=False)
    full = linear(x)
    for rows in (1, 5, 17):
        part, code = compile_and_run(lambda x: F.linear(x, w), x[:rows], dynamic=False)
        assert routed_calls(code) == ["ws_mm"]
        assert torch.equal(part, full[:rows])

    planned = []
    original = R.plan

    def recording_plan(*args, **kwargs):
        planned.append(original(*args, **kwargs))
        return planned[-1]

    settings.update(path="inline", inline_cpu=True)
    with mock.patch.object(R, "plan", recording_plan), torch.no_grad():
        for rows in (1, 5, 40):
            generated_code_only(lambda x: x @ w.t(), x[:rows], dynamic=False)
    assert len(planned) == 3
    assert len({dataclasses.replace(p.config, split_k=1, split_tail=False, swap_ab=False) for p in planned}) == 1
    assert [(p.config.split_k, p.config.split_tail) for p in planned] == [(3, False), (3, False), (3, True)]
    assert planned[2].queue.whole_tiles == 4 and [p.swap_ab for p in planned] == [True, False, False]

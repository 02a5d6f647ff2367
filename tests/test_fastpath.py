"""The fast paths through private internals (tritonblas_ops/fastpath.py) and their public
equivalents give the same bits: the same GEMMs, gradients and compiled calls run in two
processes, TRITONBLAS_OPS_FAST_PATHS on and off."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import tritonblas_ops  # noqa: F401  (registers the ops)
from subprocess_helpers import REPO
from tritonblas_ops import fastpath
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches

ops = torch.ops.tritonblas
FP32 = REL_TOLERANCE[torch.float32]

RUN = textwrap.dedent("""
    import sys
    import torch
    import tritonblas_ops
    from tritonblas_ops import fastpath, launch

    device, out_path = sys.argv[1], sys.argv[2]
    assert fastpath.ENABLED == (sys.argv[3] == "on"), fastpath.ENABLED
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [(40, 48, 56), (5, 130, 64), (37, 41, 100)] if device == "cpu" else \\
        [(4096, 4096, 4096), (5, 4000, 4096), (256, 512, 32768), (999, 777, 555)]
    results = {}
    for m, n, k in sizes:
        a = torch.randn(m, k, generator=g, device=device).to(dtype).requires_grad_()
        b = torch.randn(k, n, generator=g, device=device).to(dtype).requires_grad_()
        bias = torch.randn(n, generator=g, device=device).to(dtype)
        for call in range(2):  # the first call plans, the second takes the cached launch
            results[f"mm {m} {n} {k} {call}"] = torch.ops.tritonblas.ws_mm(a.detach(), b.detach())
            results[f"addmm {m} {n} {k} {call}"] = torch.ops.tritonblas.ws_addmm(
                bias, a.detach(), b.detach(), beta=0.5, alpha=0.1)
        out = torch.ops.tritonblas.ws_mm(a, b)
        out.backward(torch.ones_like(out))
        results[f"grads {m} {n} {k}"] = torch.cat([a.grad.flatten(), b.grad.flatten()])
        a3 = torch.randn(3, m, k, generator=g, device=device).to(dtype)
        b3 = torch.randn(3, k, n, generator=g, device=device).to(dtype)
        results[f"bmm {m} {n} {k}"] = torch.ops.tritonblas.ws_bmm(a3, b3)
        results[f"static {m} {n} {k}"] = tritonblas_ops.ws_matmul(
            a.detach(), b.detach(), schedule=tritonblas_ops.Schedule.STATIC)
    if device == "cpu":
        tritonblas_ops.route_cpu(True)
    compiled = torch.compile(lambda x, y: torch.nn.functional.gelu(x @ y))
    results["compiled"] = compiled(a.detach(), b.detach())
    kinds = {cached.launch is None for cached in launch._cache.values()}
    print("cached launches:", kinds)
    torch.save({name: t.cpu() for name, t in results.items()}, out_path)
""")


def run_both_ways(device: str, tmp_path) -> tuple[dict, dict]:
    outs = {}
    for way in ("on", "off"):
        path = tmp_path / f"{way}.pt"
        env = {**os.environ, "PYTHONPATH": str(REPO), fastpath.FAST_PATHS_ENV: "1" if way == "on" else "0"}
        proc = subprocess.run([sys.executable, "-c", RUN, device, str(path), way], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outs[way] = (torch.load(path), proc.stdout)
    return outs["on"], outs["off"]


def assert_bitwise_equal(on: dict, off: dict) -> None:
    assert on.keys() == off.keys()
    for name in on:
        assert torch.equal(on[name], off[name]), f"{name} differs between the two ways"


def test_fast_paths_on_and_off_agree_bitwise_on_cpu(tmp_path):
    (on, _), (off, _) = run_both_ways("cpu", tmp_path)
    assert_bitwise_equal(on, off)


@pytest.mark.gpu
def test_fast_paths_on_and_off_agree_bitwise_on_gpu(tmp_path):
    (on, on_log), (off, off_log) = run_both_ways("cuda", tmp_path)
    assert_bitwise_equal(on, off)
    assert "cached launches: {False}" in on_log  # every cached call took a fast launch
    assert "cached launches: {True}" in off_log  # and none did with the fast paths off


def test_rebased_descriptors_keep_their_layout():
    """A cached launch keeps its descriptors without tensors and rebases them per call:
    same layout, the new base, the kept template untouched."""
    t = torch.randn(2, 40, 24)
    descriptor = TensorDescriptor(t, [2, 40, 24], [40 * 24, 24, 1], [1, 16, 16])
    template = fastpath.rebased(descriptor, None)
    other = torch.randn(2, 40, 24)
    rebased = fastpath.rebased(template, other)
    assert rebased.base is other and template.base is None and descriptor.base is t
    assert (rebased.shape, rebased.strides, rebased.block_shape, rebased.padding) == (
        descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.padding)


def test_a_cached_launch_of_the_triton_kernel(monkeypatch):
    """The Triton kernel's argument list (pointers, descriptors of A, B and C only): the call's
    tensors go to its pointer arguments, alpha and beta to theirs."""
    from tritonblas_ops.kernel import ws_matmul_kernel

    class Kernel:  # what CompiledLaunch reads of Triton's CompiledKernel
        function, packed_metadata = "function", "metadata"
        launches = []

        def run(self, *args):
            self.launches.append(args)

    names = ws_matmul_kernel.arg_names
    args = {name: None if name.endswith(("_ptr", "_desc")) else 1.0 if name in ("alpha", "beta") else 3
            for name in names}
    monkeypatch.setattr(fastpath, "_idle", lambda hook: True)
    cached = fastpath.compiled_launch(Kernel(), names, args)
    tensors = tuple(torch.randn(2) for _ in fastpath.POINTERS)
    cached(5, 7, tensors, 0.5, 2.0)
    launched = dict(zip(names, Kernel.launches[0][9:]))
    assert all(launched[name] is tensor for name, tensor in zip(fastpath.POINTERS, tensors))
    assert (launched["alpha"], launched["beta"]) == (0.5, 2.0)


def test_a_cached_launch_of_a_kernel_without_operand_pointers(monkeypatch):
    """The warp-specialized kernel's shape of argument list: A, B and C only as (Gluon) host
    descriptors, the bias as a pointer and a descriptor (read ahead), no partials. Each call
    puts the call's tensors under the descriptors and in the pointer arguments the kernel
    has, and leaves the kept list untouched."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    def described(t):
        layout = gl.NVMMASharedLayout.get_default_for([1, 16, 16], gl.float32)
        return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), [1, 16, 16], layout)

    class Kernel:  # what CompiledLaunch reads of Triton's CompiledKernel
        function, packed_metadata = "function", "metadata"
        launches = []

        def run(self, *args):
            self.launches.append(args)

    names = ["a_desc", "b_desc", "c_desc", "bias_desc", "bias_ptr", "counters_ptr", "budget_ptr", "M", "alpha",
             "beta"]
    planned = [torch.randn(1, 32, 16) for _ in range(4)]
    args = dict(zip(names, [*map(described, planned), planned[3], torch.zeros(4, dtype=torch.int32), None, 32,
                            1.0, 0.0]))
    monkeypatch.setattr(fastpath, "_idle", lambda hook: True)
    cached = fastpath.compiled_launch(Kernel(), names, args)
    assert cached.direct is None  # not Triton 3.6's launcher: CompiledKernel.run with the list
    calls = [(*(torch.randn(1, 32, 16) for _ in range(4)), torch.zeros(4, dtype=torch.int32)) for _ in range(2)]
    for a, b, c, bias, counters in calls:
        cached(5, 7, (a, b, c, bias, counters, None, None), 0.5, 2.0)
    for (a, b, c, bias, counters), launched in zip(calls, Kernel.launches):
        assert launched[:9] == (5, 1, 1, 7, "function", "metadata", None, None, None)
        a_desc, b_desc, c_desc, bias_desc, bias_arg, counters_arg, budget, m, alpha, beta = launched[9:]
        for descriptor, tensor, template in zip((a_desc, b_desc, c_desc, bias_desc), (a, b, c, bias), args.values()):
            assert type(descriptor) is GluonTensorDescriptor and descriptor.base is tensor
            assert (descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.layout) == (
                template.shape, template.strides, template.block_shape, template.layout)
        assert (bias_arg, counters_arg, budget, m, alpha, beta) == (bias, counters, None, 32, 0.5, 2.0)
    assert all(cached.args[i].base is None for i in range(4)) and cached.args[4:6] == [None, None]


@pytest.mark.parametrize("name", ["ws_mm", "ws_addmm", "ws_bmm"])
def test_real_tensors_reach_the_body_without_custom_ops_wrappers(name, monkeypatch):
    """With the fast paths on, the body is registered straight to the CPU and CUDA keys (beside custom_op's own
    registration, which fake, autograd and tracing still use); an eager call runs it
    without custom_op's backend wrapper in between."""
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"tritonblas::{name}", key)
    from torch._library import custom_ops

    def wrapper_called(*args, **kwargs):
        raise AssertionError("custom_op's backend wrapper ran")

    op = custom_ops._maybe_get_opdef(f"tritonblas::{name}")
    monkeypatch.setattr(op, "_backend_fns", {None: wrapper_called})
    a, b = torch.randn(2, 5, 4), torch.randn(2, 4, 3)
    args = {"ws_mm": (a[0], b[0]), "ws_addmm": (torch.randn(3), a[0], b[0]), "ws_bmm": (a, b)}[name]
    expected = {"ws_mm": torch.mm, "ws_addmm": torch.addmm, "ws_bmm": torch.bmm}[name](*args)
    assert_matches(getattr(torch.ops.tritonblas, name)(*args), expected.double(), REL_TOLERANCE[torch.float32])


def _python_calls_of(fn) -> list[str]:
    """Names of the Python functions that `fn()` calls, in order."""
    calls = []

    def record(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_calls_without_grads_skip_custom_ops_autograd_layer():
    """With no input requiring grad, the dispatcher's autograd kernel runs the body itself
    (custom_op's would enter the dispatcher a second time: an OpOverload.redispatch); with
    one, custom_op's autograd runs and the output gets its grad_fn."""
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    calls = _python_calls_of(lambda: ops.ws_mm(a, b))
    assert "ws_mm" in calls and "redispatch" not in calls, calls
    with torch.no_grad():
        calls = _python_calls_of(lambda: ops.ws_mm(a.requires_grad_(), b))
    assert "ws_mm" in calls and "redispatch" not in calls, calls
    out = None

    def with_grad():
        nonlocal out
        out = ops.ws_mm(a, b)

    assert "redispatch" in _python_calls_of(with_grad)
    assert out.grad_fn is not None
    out.sum().backward()
    assert_matches(a.grad, torch.ones(8, 6).double() @ b.double().T, FP32)


@pytest.mark.skipif(not fastpath.ENABLED, reason="the cached launch before the body is a fast path")
def test_ops_launch_a_cached_plan_before_their_checks_and_body(monkeypatch):
    """A call whose plan is cached (a stand-in launch here: on the CPU none is cached)
    launches it from the autograd kernel, or under inference mode from the CPU / CUDA
    kernel, skipping the op's checks and body; a key that differs (B's dtype), an op of
    another rank or an activation of another op finds none, and the checks raise as before."""
    from tritonblas_ops import launch

    monkeypatch.setattr(fastpath, "current_device", lambda: -1)
    monkeypatch.setattr(fastpath, "current_stream", lambda index: 0)
    launched = []

    def stand_in(grid, stream, tensors, alpha, beta):
        tensors[2].fill_(7.0)  # the output
        launched.append((tensors[3], alpha, beta))

    a, b, gate = torch.randn(32, 48), torch.randn(48, 40), torch.randn(40)

    def cache(bias, alpha, beta, activation):
        key = launch._plan_key(a, b, bias, alpha, beta, activation)
        the_plan = launch.plan_for(a, b, bias, alpha, beta, activation=activation)
        monkeypatch.setitem(launch._cache, key, launch._Cached(the_plan, stand_in, the_plan.queue.numel))

    cache(None, 1.0, 1.0, "none")
    cache(gate, 0.5, 2.0, "none")
    cache(gate, 1.0, 1.0, "gate_silu")
    sevens = torch.full((32, 40), 7.0)
    assert torch.equal(ops.ws_mm(a, b), sevens) and launched.pop() == (None, 1.0, 1.0)
    assert torch.equal(ops.ws_addmm(gate, a, b, beta=2.0, alpha=0.5), sevens)
    assert launched.pop() == (gate, 0.5, 2.0)
    assert torch.equal(ops.ws_mm_gated(a, b, gate, activation="silu"), sevens)
    assert launched.pop() == (gate, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.ws_mm(a, b.double())
    with pytest.raises(RuntimeError, match="must be a 3-D tensor"):
        ops.ws_bmm(a, b)
    with pytest.raises(RuntimeError, match="activation must be one of"):
        ops.ws_mm_act(a, b, gate, activation="gate_silu")
    assert launched == []
    # Under inference mode the dispatcher skips autograd's kernel, and the backend's tries the plan.
    with torch.inference_mode():
        calls = _python_calls_of(lambda: ops.ws_addmm(gate, a, b, beta=2.0, alpha=0.5))
    assert "shortcut" not in calls and "_ws_addmm_cached" in calls and "ws_addmm" not in calls, calls
    assert launched.pop() == (gate, 0.5, 2.0)
    # A call that needs a gradient takes autograd's way down to the backend's kernel: the plan.
    out = ops.ws_mm(a.requires_grad_(), b)
    assert out.grad_fn is not None and torch.equal(out, sevens) and launched == [(None, 1.0, 1.0)]

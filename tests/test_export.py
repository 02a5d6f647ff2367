"""torch.export and AOTInductor: the ops survive export by name (NOTE [Export custom triton
op] in torch/_library/triton.py) and round-trip through torch.export.save / load; an
AOTInductor package of a routed model runs the work-stealing kernel (GPU), and runs with only
the C++ stubs, in Python and in a C++ program (CPU and GPU)."""

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.export import Dim

import tritonblas_ops  # noqa: F401
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, matmul_ref

from subprocess_helpers import run_python, stubs_only

OPS = {torch.ops.tritonblas.ws_mm.default, torch.ops.tritonblas.ws_addmm.default,
       torch.ops.tritonblas.ws_bmm.default}


class Model(torch.nn.Module):
    """All three ops, called explicitly; rows of x and the batch of y may vary."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12, 16))
        self.bias = torch.nn.Parameter(torch.randn(16))

    def forward(self, x, y):
        h = torch.ops.tritonblas.ws_addmm(self.bias, x, self.w, beta=0.5, alpha=2.0)
        h = torch.ops.tritonblas.ws_mm(h.relu(), self.w.t())  # (rows, 12)
        return torch.ops.tritonblas.ws_bmm(y, h.t().expand(y.shape[0], 12, -1))  # (batch, 5, rows)


def reference(model, x, y):
    h = matmul_ref(x, model.w, model.bias, alpha=2.0, beta=0.5).relu()
    h = matmul_ref(h, model.w.t())
    return matmul_ref(y, h.t().expand(y.shape[0], 12, -1))


def op_targets(program) -> list:
    return sorted(str(n.target) for n in program.graph.nodes if n.target in OPS)


EXPECTED = ["tritonblas.ws_addmm.default", "tritonblas.ws_bmm.default", "tritonblas.ws_mm.default"]


def test_exported_program_runs_with_only_the_stubs(stubs, tmp_path):
    """Exported where tritonblas_ops is installed, run where only the C++ stubs are."""
    model = Model()
    x, y = torch.randn(8, 12), torch.randn(2, 5, 12)
    torch.export.save(torch.export.export(model, (x, y)), tmp_path / "model.pt2")
    torch.save((x, y), tmp_path / "inputs.pt")
    stubs_only(stubs, f"""
        program = torch.export.load({str(tmp_path / "model.pt2")!r})
        x, y = torch.load({str(tmp_path / "inputs.pt")!r})
        with torch.no_grad():
            torch.save(program.module()(x, y), {str(tmp_path / "out.pt")!r})
    """)
    with torch.no_grad():
        assert_matches(torch.load(tmp_path / "out.pt"), reference(model, x, y), REL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_export_keeps_the_ops_and_round_trips(dynamic, tmp_path):
    model = Model()
    x, y = torch.randn(8, 12), torch.randn(2, 5, 12)
    shapes = {"x": {0: Dim("rows", min=2)}, "y": {0: Dim("batch", min=2)}} if dynamic else None
    program = torch.export.export(model, (x, y), dynamic_shapes=shapes)
    assert op_targets(program) == EXPECTED

    torch.export.save(program, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2")
    assert op_targets(loaded) == EXPECTED

    inputs = [(x, y)] + ([(torch.randn(11, 12), torch.randn(3, 5, 12))] if dynamic else [])
    for args in inputs:
        with torch.no_grad():
            eager, out = model(*args), loaded.module()(*args)
        assert torch.equal(out, eager)  # the same kernel, run the same way: bit for bit
        assert_matches(out, reference(model, *args), REL_TOLERANCE[torch.float32])


def test_decompositions_keep_the_ops():
    """run_decompositions (what AOTInductor starts from) leaves the ops whole."""
    program = torch.export.export(Model(), (torch.randn(8, 12), torch.randn(2, 5, 12)))
    assert op_targets(program.run_decompositions()) == EXPECTED


# ---------------------------------------------------------------------------------------
# AOTInductor. Compiled in one subprocess and loaded in another: a crash fails the test
# instead of killing pytest, and loading never shares a process with the compiler.
# ---------------------------------------------------------------------------------------

AOTI_COMPILE = """
    import importlib, json, zipfile
    import torch
    if {routed}:
        import tritonblas_ops  # routing on
        tritonblas_ops.set_policy("all")  # these small GEMMs too

    device, dtype = {device!r}, {dtype}
    if {routed} and device == "cpu":  # CPU GEMMs are routed only on request
        tritonblas_ops.route_cpu(True)
    torch.manual_seed(0)

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 96)  # aten.addmm once lowered: routed
            self.w = torch.nn.Parameter(torch.randn(96, 48) / 10)

        def forward(self, x):
            h = self.proj(x).relu()
            if {routed}:
                return torch.ops.tritonblas.ws_mm(h, self.w)  # the triton_op itself
            return h @ self.w

    model = Routed().to(device, dtype)
    x = torch.randn(200, 64, device=device, dtype=dtype)
    package = {package!r}
    with torch.no_grad():
        eager = model(x)
        program = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(program, package_path=package)
    torch.save({{"x": x, "eager": eager}}, package + ".tensors")
    with zipfile.ZipFile(package) as archive:
        blob = b"".join(archive.read(name) + name.encode() for name in archive.namelist())
    print(json.dumps({{
        "kernel_in_package": b"ws_matmul_kernel" in blob,
        "op_call_in_package": b"ws_addmm" in blob,
    }}))
"""

AOTI_RUN = """
    import json, torch
    import tritonblas_ops  # noqa: F401  (the ops the package may call)

    tensors = torch.load({package!r} + ".tensors")
    with torch.no_grad():
        tensors["out"] = torch._inductor.aoti_load_package({package!r})(tensors["x"])
    torch.save(tensors, {package!r} + ".tensors")
    print(json.dumps({{}}))
"""

AOTI_DTYPES = {"cuda": torch.float16, "cpu": torch.float32}


def compile_package(tmp_path: pathlib.Path, device: str, path: str = "opaque",
                    routed: bool = True) -> tuple[str, dict]:
    """An AOTInductor package of a model with one routed Linear and one explicit ws_mm (or,
    not routed, the same model in plain torch), and what its files name; its input and
    eager output are saved beside it."""
    package = str(tmp_path / f"{'routed' if routed else 'plain'}_{device}_{path}.pt2")
    code = f"import os\nos.environ['TRITONBLAS_OPS_ROUTING_PATH'] = {path!r}\n"
    code += textwrap.dedent(AOTI_COMPILE).format(device=device, dtype=AOTI_DTYPES[device],
                                                 package=package, routed=routed)
    result, _ = run_python(code, timeout=600)
    return package, result


def run_package(package: str) -> torch.Tensor:
    """Load and run the package in a fresh process with tritonblas_ops imported."""
    run_python(textwrap.dedent(AOTI_RUN).format(package=package))
    return torch.load(package + ".tensors")["out"]


@pytest.fixture(scope="module")
def aoti_runs_cuda_packages(tmp_path_factory) -> None:
    """Control: a package of plain torch (no tritonblas op or kernel in it) must load and
    run here, or a failure below says nothing about this project. On the lent H200 (torch
    2.11) loading any CUDA package segfaulted (benchmarks/RESULTS.md, AOTInductor)."""
    package, _ = compile_package(tmp_path_factory.mktemp("control"), "cuda", routed=False)
    code = (f"import torch\nx = torch.load({package + '.tensors'!r})['x']\n"
            f"torch._inductor.aoti_load_package({package!r})(x)\ntorch.cuda.synchronize()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode < 0:
        pytest.skip(f"AOTInductor itself dies (signal {-proc.returncode}) running a plain-torch "
                    f"CUDA package with torch {torch.__version__} here")
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.usefixtures("aoti_runs_cuda_packages")
@pytest.mark.parametrize("path", ["opaque", "inline"])
def test_aoti_package_runs_the_kernel(path, tmp_path):
    package, found = compile_package(tmp_path, "cuda", path)
    out = run_package(package)
    assert_matches(out, torch.load(package + ".tensors")["eager"].double(), REL_TOLERANCE[torch.float16])
    # The explicit ws_mm is decomposed into its Triton kernel, compiled into the package;
    # the routed Linear is a call of the op (opaque) or the kernel again (inline).
    assert found["kernel_in_package"]
    assert found["op_call_in_package"] == (path == "opaque")


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> str:
    """csrc_stubs/run_package.cpp built: a program that runs a package without Python."""
    directory = str(tmp_path_factory.getbasetemp() / "stubs")  # where the stubs fixture builds
    result, _ = run_python(f"""
        import json, os
        os.environ["TRITONBLAS_OPS_STUBS_DIR"] = {directory!r}
        from tritonblas_ops import stubs
        print(json.dumps({{"path": str(stubs.build_runner())}}))
    """)
    return result["path"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_aoti_package_runs_with_only_the_stubs(device, stubs, tmp_path, request):
    """Deployment without tritonblas_ops: the package's kernels are compiled in, and its
    calls of the routed op find the stubs' aten fallback; on CPU, in a C++ program too."""
    if device == "cuda":
        request.getfixturevalue("aoti_runs_cuda_packages")
    package, found = compile_package(tmp_path, device)
    assert found["op_call_in_package"]
    run_package(package)
    run_python(f"""
        import json, sys, torch
        torch.ops.load_library({stubs!r})
        tensors = torch.load({package + ".tensors"!r})
        with torch.no_grad():
            out = torch._inductor.aoti_load_package({package!r})(tensors["x"])
        torch.save(out, {package + ".stubs_out"!r})
        assert "tritonblas_ops" not in sys.modules
        print(json.dumps({{}}))
    """)
    tensors = torch.load(package + ".tensors")
    eager, tolerance = tensors["eager"].double(), REL_TOLERANCE[AOTI_DTYPES[device]]
    assert_matches(tensors["out"], eager, tolerance)
    assert_matches(torch.load(package + ".stubs_out"), eager, tolerance)
    if device != "cpu":
        return

    # No Python at all: a C++ program, whose environment holds only libtorch's folder (as a
    # deployment's would: some torch versions build AOTInductor packages without an rpath to
    # it), loads the stubs and the package (its operand and result as raw float32 files).
    x = tensors["x"]
    x.numpy().tofile(tmp_path / "x.bin")
    program = [request.getfixturevalue("runner"), stubs, package, str(tmp_path / "x.bin"),
               *map(str, x.shape), str(tmp_path / "out.bin")]
    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib")
    proc = subprocess.run(program, env={"LD_LIBRARY_PATH": libtorch}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    out = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32))
    assert_matches(out.view(eager.shape), eager, tolerance)

"""The C++ stubs (csrc_stubs/): built here, then checked in subprocesses, since a loaded library
cannot be unloaded and the point is what each process sees:
- the schemas they register are schemas.SCHEMAS, which the Python ops are held to too;
- alone (no tritonblas_ops), they run aten's GEMMs, refuse bad input as the Python ops do,
  give output shapes for meta and symbolic sizes, and run an exported program;
- loaded before or after tritonblas_ops, nothing is defined twice and the Python
  implementations are the ones used: eager, fake, autograd, torch.compile.
"""

import shutil
import subprocess

import pytest
import torch

import tritonblas_ops  # noqa: F401
from subprocess_helpers import run_python, stubs_only
from tritonblas_ops.schemas import SCHEMAS, defined_schema

# ---------------------------------------------------------------------------------------
# One schema per op, on both sides
# ---------------------------------------------------------------------------------------


def test_python_ops_have_the_schemas_of_schemas_py():
    for name, schema in SCHEMAS.items():
        assert defined_schema(name) == schema
        assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.tritonblas, name).default.tags


def test_cpp_library_registers_the_schemas_of_schemas_py(stubs):
    result, _ = stubs_only(stubs, """
        for name in ("ws_mm", "ws_addmm", "ws_bmm", "ws_mm_act", "ws_mm_gated", "ws_grouped_mm"):
            op = getattr(torch.ops.tritonblas, name).default
            dump = torch._C._dispatch_dump(f"tritonblas::{name}")
            kernels = [line.split(":")[0] for line in dump.splitlines() if "tritonblas_stubs.cpp" in line]
            result[name] = [str(op._schema), [str(t) for t in op.tags], kernels]
    """)
    assert set(result) == set(SCHEMAS)
    for name, (schema, tags, kernels) in result.items():
        assert schema == SCHEMAS[name], f"the C++ stubs and schemas.py differ for {name}"
        assert tags == ["Tag.pt2_compliant_tag"]
        assert kernels == ["debug", "CompositeExplicitAutograd[alias]"]  # the def and one kernel


def test_library_does_not_need_python(stubs):
    """cpp_extension links libtorch_python; the stubs must not keep it (nor libpython), or a
    process without Python could not load them."""
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) is needed to read the library's dependencies"
    dynamic = subprocess.run([readelf, "-d", stubs], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert "libtorch_cpu.so" in needed
    assert not [lib for lib in needed if "python" in lib], needed


# ---------------------------------------------------------------------------------------
# The stubs alone: aten fallback, checks, shapes
# ---------------------------------------------------------------------------------------


def test_fallback_kernels_are_aten(stubs):
    result, _ = stubs_only(stubs, """
        ops = torch.ops.tritonblas
        a, b, bias = torch.randn(19, 23), torch.randn(23, 29), torch.randn(29)
        h = torch.randn(19, 29)  # an activation's input: the gate of a slope
        a3, b3 = torch.randn(3, 19, 23), torch.randn(3, 23, 29)
        t = lambda x: x.mT.contiguous().mT
        nan_bias = torch.full((29,), float("nan"))
        cases = {
            "mm": (ops.ws_mm(a, b), torch.mm(a, b)),
            "mm_transposed": (ops.ws_mm(t(a), t(b)), torch.mm(a, b)),
            "mm_fp16": (ops.ws_mm(a.half(), b.half()), torch.mm(a.half(), b.half())),
            "addmm": (ops.ws_addmm(bias, a, b, beta=0.5, alpha=2.0), torch.addmm(bias, a, b, beta=0.5, alpha=2.0)),
            "addmm_column_bias": (ops.ws_addmm(bias[:19, None], a, b), torch.addmm(bias[:19, None], a, b)),
            "addmm_beta_zero_nan_bias": (ops.ws_addmm(nan_bias, a, b, beta=0.0), torch.mm(a, b)),
            "bmm": (ops.ws_bmm(a3, b3), torch.bmm(a3, b3)),
            "zero_k": (ops.ws_mm(torch.randn(4, 0), torch.randn(0, 6)), torch.zeros(4, 6)),
            "mm_act_gelu_tanh": (ops.ws_mm_act(a, b, bias, activation="gelu_tanh"),
                                 torch.nn.functional.gelu(torch.addmm(bias, a, b), approximate="tanh")),
            "mm_act_silu": (ops.ws_mm_act(a, b, None, activation="silu"), torch.nn.functional.silu(a @ b)),
            "mm_act_scaled_residual": (ops.ws_mm_act(a, b, h, activation="none", alpha=0.5),
                                       torch.addmm(h, a, b, alpha=0.5)),
            "mm_act_scaled": (ops.ws_mm_act(a, b, None, activation="relu", alpha=-2.0), torch.relu((a @ b) * -2.0)),
            "mm_gated_silu": (ops.ws_mm_gated(a, b, bias, activation="silu"),
                              torch.nn.functional.silu(bias) * (a @ b)),
            "mm_gated_d_gelu_tanh": (ops.ws_mm_gated(a, b, h, activation="d_gelu_tanh"),
                                     torch.ops.aten.gelu_backward(a @ b, h, approximate="tanh")),
            "mm_gated_d_silu": (ops.ws_mm_gated(a, b, h, activation="d_silu"),
                                torch.ops.aten.silu_backward(a @ b, h)),
        }
        result["equal"] = {k: torch.equal(ours, ref) for k, (ours, ref) in cases.items()}
        meta = lambda *shape: torch.empty(shape, device="meta")
        result["meta_shapes"] = [
            list(ops.ws_mm(meta(4, 5), meta(5, 6)).shape),
            list(ops.ws_addmm(meta(6), meta(4, 5), meta(5, 6)).shape),
            list(ops.ws_bmm(meta(2, 4, 5), meta(2, 5, 6)).shape),
            list(ops.ws_mm_act(meta(4, 5), meta(5, 6), None, activation="relu").shape),
            list(ops.ws_mm_gated(meta(4, 5), meta(5, 6), meta(6), activation="silu").shape),
            list(ops.ws_grouped_mm(meta(9, 5), meta(3, 5, 6), torch.empty(3, dtype=torch.int32, device="meta")).shape),
        ]
        try:
            ops.ws_mm_act(a, b, None, activation="tanh")
        except RuntimeError as e:
            result["bad_activation"] = str(e).splitlines()[0]
        try:
            ops.ws_mm_gated(a, b, h, activation="tanh")
        except RuntimeError as e:
            result["bad_gate_function"] = str(e).splitlines()[0]

        # Under torch.compile the op stays one opaque call (no Python decomposition here), and
        # its shape function takes symbolic sizes: compiled once for two sizes.
        from torch._dynamo.backends.common import aot_autograd
        graphs = []
        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm
        fn = torch.compile(lambda x, y, c: ops.ws_addmm(c, x, y, beta=0.5) + ops.ws_mm(x, y),
                           backend=aot_autograd(fw_compiler=capture), dynamic=True)
        result["compiled_close"] = [
            torch.allclose(fn(x, b, bias), torch.addmm(bias, x, b, beta=0.5) + x @ b, atol=1e-5)
            for x in (torch.randn(8, 23), torch.randn(12, 23))
        ]
        result["graphs"] = len(graphs)
        result["graph_targets"] = sorted(
            str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function" and "tritonblas" in str(n.target))
    """)
    assert result["equal"] == {k: True for k in result["equal"]}
    assert result["meta_shapes"] == [[4, 6], [4, 6], [2, 4, 6], [4, 6], [4, 6], [9, 6]]
    assert result["bad_activation"] == first_error_line("ws_mm_act", "torch.randn(19, 23), torch.randn(23, 29), None, activation='tanh'")
    assert result["bad_gate_function"] == first_error_line(
        "ws_mm_gated", "torch.randn(19, 23), torch.randn(23, 29), torch.randn(19, 29), activation='tanh'")
    assert result["compiled_close"] == [True, True]
    assert result["graphs"] == 1
    assert result["graph_targets"] == ["tritonblas.ws_addmm.default", "tritonblas.ws_mm.default"]


M = "torch.randn(4, 5)"
BAD_INPUTS = [  # (op, arguments as Python source): evaluated in both processes
    ("ws_mm", f"torch.randn(4), {M}"),
    ("ws_mm", f"{M}, torch.randn(2, 5, 3)"),
    ("ws_mm", f"{M}, torch.randn(6, 3)"),
    ("ws_mm", f"{M}, torch.randn(5, 3, dtype=torch.float16)"),
    ("ws_mm", "torch.randn(4, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)"),
    ("ws_mm", "torch.ones(4, 5, dtype=torch.int32), torch.ones(5, 3, dtype=torch.int32)"),
    ("ws_mm", f"{M}, torch.randn(5, 3, device='meta')"),
    ("ws_mm", f"{M}.to_sparse(), torch.randn(5, 3)"),
    ("ws_mm", f"{M}, 3.0"),
    ("ws_bmm", "torch.randn(2, 4, 5), torch.randn(3, 5, 6)"),
    ("ws_bmm", f"{M}, torch.randn(5, 6)"),
    ("ws_addmm", f"torch.randn(4, 7), {M}, torch.randn(5, 6)"),
    ("ws_addmm", f"torch.randn(2, 4, 6), {M}, torch.randn(5, 6)"),
    ("ws_addmm", f"torch.randn(6, dtype=torch.float16), {M}, torch.randn(5, 6)"),
    ("ws_addmm", f"torch.randn(6, device='meta'), {M}, torch.randn(5, 6)"),
]


def first_error_line(op: str, args: str) -> str:
    """The first line of the error the Python op raises on these arguments (Python source)."""
    try:
        eval(f"torch.ops.tritonblas.{op}({args})")
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "no error"


def test_fallback_refuses_bad_input_as_the_python_ops_do(stubs):
    result, _ = stubs_only(stubs, f"""
        result["errors"] = []
        for op, args in {BAD_INPUTS!r}:
            try:
                getattr(torch.ops.tritonblas, op)(*eval(f"({{args}},)"))
                result["errors"].append("no error")
            except RuntimeError as e:
                result["errors"].append(str(e).splitlines()[0])
    """)
    python = [first_error_line(op, args) for op, args in BAD_INPUTS]
    assert "no error" not in python
    assert result["errors"] == python


# ---------------------------------------------------------------------------------------
# Both in one process, in either order
# ---------------------------------------------------------------------------------------

# The torch versions (about 2.8 to 2.12) whose Library.impl and register_fake refuse to
# replace a kernel default to allow_override=False; 2.13 defaults to True. The strict run
# forces False, so the stubs-first order is checked against those versions too.
STRICT_REGISTRATION = """
    from torch import library
    from torch._library import fake_impl
    register, impl = fake_impl.FakeImplHolder.register, library.Library.impl
    fake_impl.FakeImplHolder.register = (
        lambda self, *args, allow_override=False, **kwargs: register(self, *args, allow_override=False, **kwargs))
    library.Library.impl = (
        lambda self, *args, allow_override=False, **kwargs: impl(self, *args, allow_override=False, **kwargs))
"""

LOAD_ORDER = """
    import json, sys, warnings
    import torch
    {strict}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        {first}
        {second}
    from torch.library import opcheck
    from tritonblas_ops import ops
    result = {{"warnings": [str(w.message) for w in caught
                           if "tritonblas" in str(w.message) or "Overriding" in str(w.message)]}}

    # Whose schema, and whose kernels are active: the Python ones, whatever the order.
    result["schema_from"], result["cpp_kernels_active"] = {{}}, {{}}
    for name in ("ws_mm", "ws_addmm", "ws_bmm", "ws_mm_act", "ws_mm_gated", "ws_grouped_mm"):
        lines = torch._C._dispatch_dump(f"tritonblas::{{name}}").splitlines()
        debug = next(line for line in lines if line.startswith("debug:"))
        result["schema_from"][name] = "cpp" if "tritonblas_stubs.cpp" in debug else "python"
        result["cpp_kernels_active"][name] = [
            line.split(":")[0] for line in lines
            if "tritonblas_stubs.cpp" in line and not line.startswith("debug:") and "(inactive)" not in line]

    # Eager calls run the Triton kernel (here through the interpreter).
    launches = []
    ws_matmul = ops.ws_matmul
    ops.ws_matmul = lambda *args, **kwargs: launches.append(1) or ws_matmul(*args, **kwargs)
    a, b, bias, a3, b3 = (torch.randn(9, 10), torch.randn(10, 11), torch.randn(11),
                          torch.randn(2, 9, 10), torch.randn(2, 10, 11))
    ops_ = torch.ops.tritonblas
    outs = [ops_.ws_mm(a, b), ops_.ws_addmm(bias, a, b, beta=0.5), ops_.ws_bmm(a3, b3),
            ops_.ws_mm_act(a, b, bias, activation="silu")]
    refs = [a @ b, torch.addmm(bias, a, b, beta=0.5), a3 @ b3, torch.nn.functional.silu(torch.addmm(bias, a, b))]
    ops.ws_matmul = ws_matmul
    result["kernel_launches"] = len(launches)
    result["eager_close"] = all(torch.allclose(o, r, atol=1e-5) for o, r in zip(outs, refs))

    # Fake kernels, autograd, aot_dispatch: opcheck, gradients on.
    opcheck(ops_.ws_addmm, (bias, a.requires_grad_(), b.requires_grad_()), {{"beta": 0.5}})

    # torch.compile: the triton_op decomposition runs (for CPU inputs the traced body is
    # aten's GEMM), so no opaque tritonblas call is left in the graph.
    from torch._dynamo.backends.common import aot_autograd
    graphs = []
    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm
    fn = torch.compile(lambda x, y, c, x3, y3: (ops_.ws_mm(x, y), ops_.ws_addmm(c, x, y), ops_.ws_bmm(x3, y3)),
                       backend=aot_autograd(fw_compiler=capture))
    compiled = fn(a.detach(), b.detach(), bias, a3, b3)
    result["compiled_close"] = torch.allclose(compiled[1], torch.addmm(bias, a, b), atol=1e-5)
    result["graph_targets"] = sorted({{str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}})
    print(json.dumps(result))
"""


@pytest.mark.parametrize("order", ["stubs_first", "package_first", "stubs_first_strict"])
def test_load_order(stubs, order):
    load_stubs, load_package = f"torch.ops.load_library({stubs!r})", "import tritonblas_ops"
    first, second = (load_package, load_stubs) if order == "package_first" else (load_stubs, load_package)
    code = LOAD_ORDER.format(strict=STRICT_REGISTRATION if order.endswith("strict") else "",
                             first=first, second=second)
    result, _ = run_python(code)
    schema_owner = "python" if order == "package_first" else "cpp"
    assert result["schema_from"] == {name: schema_owner for name in SCHEMAS}
    assert result["cpp_kernels_active"] == {name: [] for name in SCHEMAS}
    assert result["warnings"] == []
    assert result["kernel_launches"] == 4
    assert result["eager_close"] and result["compiled_close"]
    assert "aten.mm.default" in result["graph_targets"]
    assert not [t for t in result["graph_targets"] if "tritonblas" in t]


def test_a_different_cpp_schema_is_refused_clearly():
    """Stubs built from another version of the package: importing it names both schemas."""
    result, _ = run_python("""
        import json, torch
        lib = torch.library.Library("tritonblas", "FRAGMENT")
        lib.define("ws_mm(Tensor a, Tensor b, int c) -> Tensor")  # stands in for stale stubs
        try:
            import tritonblas_ops
            print(json.dumps({"error": None}))
        except RuntimeError as e:
            print(json.dumps({"error": str(e)}))
    """)
    assert "tritonblas::ws_mm(Tensor a, Tensor b, int c) -> Tensor" in result["error"]
    assert SCHEMAS["ws_mm"] in result["error"]


def test_stubs_leave_a_differently_defined_op_alone(stubs):
    """An op that already exists with another schema keeps it (and its kernels), with a
    warning; the stubs still define the others."""
    result, stderr = run_python(f"""
        import json, torch
        lib = torch.library.Library("tritonblas", "FRAGMENT")
        lib.define("ws_mm(Tensor a) -> Tensor")
        torch.ops.load_library({stubs!r})
        print(json.dumps({{
            "ws_mm": str(torch.ops.tritonblas.ws_mm.default._schema),
            "ws_mm_kernels": "tritonblas_stubs.cpp" in torch._C._dispatch_dump("tritonblas::ws_mm"),
            "ws_bmm": str(torch.ops.tritonblas.ws_bmm.default._schema),
        }}))
    """)
    assert result == {"ws_mm": "tritonblas::ws_mm(Tensor a) -> Tensor", "ws_mm_kernels": False,
                      "ws_bmm": SCHEMAS["ws_bmm"]}
    assert "tritonblas::ws_mm is already defined as" in stderr


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["stubs_first", "package_first"])
def test_compiled_code_has_the_kernel_in_either_order(stubs, order):
    """On a GPU the decomposition traces the Triton kernel itself: it is in the AOT graph and
    in Inductor's generated code, whichever side defined the op."""
    load_stubs, load_package = f"torch.ops.load_library({stubs!r})", "import tritonblas_ops"
    first, second = (load_package, load_stubs) if order == "package_first" else (load_stubs, load_package)
    result, _ = run_python(f"""
        import json, torch
        {first}
        {second}
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.utils import run_and_get_code
        a = torch.randn(256, 128, device="cuda", dtype=torch.float16)
        b = torch.randn(128, 192, device="cuda", dtype=torch.float16)
        mm = lambda x, y: torch.ops.tritonblas.ws_mm(x, y)
        graphs = []
        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm
        torch.compile(mm, backend=aot_autograd(fw_compiler=capture))(a, b)
        out, codes = run_and_get_code(torch.compile(mm), a, b)
        print(json.dumps({{
            "graph_targets": sorted({{str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}}),
            "kernel_in_code": "ws_matmul_kernel" in "".join(codes),
            "close": torch.allclose(out.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-2),
        }}))
    """)
    assert "triton_kernel_wrapper_functional" in " ".join(result["graph_targets"])
    assert result["kernel_in_code"] and result["close"]

"""The schemas of torch.ops.tritonblas.*, and how the Python ops adopt ones defined in C++.

Two places declare these ops: tritonblas_ops/ops.py (a `triton_op` each, whose schema torch
infers from the type annotations) and csrc_stubs/tritonblas_stubs.cpp (TORCH_LIBRARY_FRAGMENT,
for processes without Python). SCHEMAS is what both must say, verbatim as torch prints a
schema; tests/test_csrc_stubs.py checks the Python ops and the compiled C++ library against it.

Either may be loaded first in one process. When the C++ library came first, the ops exist
before ops.py runs, and `triton_op` would define them again, which the dispatcher refuses.
`adopt_cpp_definitions()` lets ops.py run unchanged then: while it is active, defining an op
that already exists with the identical schema registers nothing and the op is adopted as is;
the implementations that `triton_op` registers next (kernel, fake, autograd, the
torch.compile decomposition) then take precedence over the C++ fallback ones. (The other
order is the C++ library's business: it leaves alone any op that already has a schema.)
"""

import contextlib
import warnings

import torch

NAMESPACE = "tritonblas"

SCHEMAS = {
    "ws_mm": "tritonblas::ws_mm(Tensor a, Tensor b) -> Tensor",
    "ws_addmm": (
        "tritonblas::ws_addmm(Tensor bias, Tensor a, Tensor b, *, float beta=1., float alpha=1.)"
        " -> Tensor"
    ),
    "ws_bmm": "tritonblas::ws_bmm(Tensor a, Tensor b) -> Tensor",
    "ws_mm_act": (
        "tritonblas::ws_mm_act(Tensor a, Tensor b, Tensor? bias, *, str activation, float alpha=1.)"
        " -> Tensor"
    ),
    "ws_mm_gated": "tritonblas::ws_mm_gated(Tensor a, Tensor b, Tensor gate, *, str activation) -> Tensor",
    "ws_grouped_mm": (
        "tritonblas::ws_grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None,"
        " ScalarType? out_dtype=None) -> Tensor"
    ),
}


def defined_schema(name: str) -> str | None:
    """The schema the dispatcher holds for tritonblas::name, or None when there is none."""
    try:
        return str(getattr(getattr(torch.ops, NAMESPACE), name).default._schema)
    except (AttributeError, RuntimeError):
        return None


@contextlib.contextmanager
def adopt_cpp_definitions():
    """While active, `Library.define` of a tritonblas op that already has the identical
    schema (the C++ stubs defined it) is a no-op; a different schema is an error naming both.
    Other namespaces and new ops are defined as usual."""
    define = torch.library.Library.define

    def define_or_adopt(self, schema, *args, **kwargs):
        name = schema.split("(")[0].split("::")[-1]
        existing = defined_schema(name) if self.ns == NAMESPACE else None
        if existing is None:
            return define(self, schema, *args, **kwargs)
        wanted = str(torch._C.parse_schema(f"{NAMESPACE}::{schema.split('::')[-1]}"))
        if existing != wanted:
            raise RuntimeError(
                f"{NAMESPACE}::{name} is already defined (by the C++ stubs, "
                f"csrc_stubs/tritonblas_stubs.cpp?) as '{existing}', but tritonblas_ops "
                f"defines it as '{wanted}': rebuild the stubs (python -m tritonblas_ops.stubs "
                f"build) with this version of tritonblas_ops"
            )
        return name

    torch.library.Library.define = define_or_adopt
    try:
        # The Python kernels replace the C++ fallback at CompositeExplicitAutograd, which the
        # dispatcher reports as an override: that replacement is the point here.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"(?s).*Overriding a previously registered kernel"
            )
            yield
    finally:
        torch.library.Library.define = define

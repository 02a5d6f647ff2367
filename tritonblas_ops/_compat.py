"""What differs between the torch versions we support (2.11 on the GPU machine, 2.13 in CI,
2.14 what a fresh `pip install` takes here).

Everything else in the package uses APIs that are the same in all of them.
"""

import inspect

from torch._higher_order_ops import triton_kernel_wrap
from torch._inductor import config as inductor_config
from torch._inductor import custom_graph_pass
from torch._inductor import ir
from torch._inductor.virtualized import V

# torch 2.13 lets a post-grad pass slot hold a list of passes (and calls, keys and checks
# each); torch 2.11 holds one pass. Detected by the helper that reads such a list.
_PASS_LISTS = hasattr(custom_graph_pass, "get_custom_graph_passes")


class _PassPair(custom_graph_pass.CustomGraphPass):
    """Two post-grad passes in one slot, for torch 2.11."""

    def __init__(self, first, second):
        self.first = first
        self.second = second

    def __call__(self, graph):
        self.first(graph)
        self.second(graph)

    def uuid(self):
        uuids = [p.uuid() if isinstance(p, custom_graph_pass.CustomGraphPass) else None
                 for p in (self.first, self.second)]
        # Inductor bypasses its caches for a pass without a uuid; keep that true for the pair.
        return None if None in uuids else tuple(uuids)


def post_grad_post_passes() -> tuple:
    """The passes now in `config.post_grad_custom_post_pass`, flattened."""
    current = inductor_config.post_grad_custom_post_pass
    if _PASS_LISTS:
        return custom_graph_pass.get_custom_graph_passes(current)
    return () if current is None else _flatten(current)


def _flatten(p) -> tuple:
    return (*_flatten(p.first), *_flatten(p.second)) if isinstance(p, _PassPair) else (p,)


def append_post_grad_post_pass(new_pass) -> None:
    """Run `new_pass` after whatever post-grad post pass the user already set, keeping theirs."""
    current = inductor_config.post_grad_custom_post_pass
    if current is None:
        inductor_config.post_grad_custom_post_pass = new_pass
    elif _PASS_LISTS:
        passes = custom_graph_pass.get_custom_graph_passes(current)
        inductor_config.post_grad_custom_post_pass = [*passes, new_pass]
    else:
        inductor_config.post_grad_custom_post_pass = _PassPair(current, new_pass)


# torch 2.14 adds a required `launch_kwargs` (the kernel arguments passed as launch keywords)
# to Inductor's user-defined Triton kernel node; ours passes none.
_LAUNCH_KWARGS = "launch_kwargs" in inspect.signature(ir.UserDefinedTritonKernel.__init__).parameters


def user_defined_triton_kernel(**kwargs) -> ir.UserDefinedTritonKernel:
    """ir.UserDefinedTritonKernel(**kwargs), with no launch keywords where torch asks for them."""
    if _LAUNCH_KWARGS:
        kwargs.setdefault("launch_kwargs", ())
    return ir.UserDefinedTritonKernel(**kwargs)


def inductor_buffer_aligned(name: str) -> bool:
    """Whether Inductor holds buffer `name`'s base address 16-byte aligned while the graph
    runs: the rule its own Triton kernels follow (Note: [Input Alignment handling in
    Inductor]; torch 2.13's codegen.triton_utils.is_unaligned_buffer_name, which 2.11 lacks
    under that name). A graph input whose example was aligned is copied at run time if a
    later one is not; constants and the buffers Inductor allocates are aligned; a buffer
    laid out inside another's storage (NonOwningLayout) may not be, and counts as not."""
    graph = V.graph
    if name in graph.unaligned_buffers:
        return False
    if name in graph.graph_inputs or name in graph.constants:
        return True
    buffer = graph.get_buffer(name)
    return buffer is not None and not isinstance(buffer.get_layout(), ir.NonOwningLayout)


# Inductor's analysis of what a user-defined Triton kernel reads and writes: torch 2.13's
# traces tensor-descriptor arguments built on the host; 2.11's fails on them (it traces the
# kernel with a host TensorDescriptor where the descriptor goes) and then counts every input
# as written, which makes CUDA graphs skip a graph whose inputs feed such a kernel. Detected
# by 2.13's entry point to that analysis.
HOST_DESCRIPTOR_ARGUMENTS = hasattr(triton_kernel_wrap, "identify_accessed_tensors")

"""Every shortcut through private torch and Triton internals, behind one switch.

Each saves host time on the eager hot path and has a public equivalent, named beside it,
that gives the same results: `TRITONBLAS_OPS_FAST_PATHS=0` (read at import) takes the
public way everywhere, and tests/test_fastpath.py checks both ways give equal bits.

- CUDA stream, current device and device guard: torch._C's functions instead of
  torch.cuda's wrappers.
- Cached launches call Triton's compiled kernel directly with the plan's argument list
  (CompiledKernel.run, the C launcher under it), instead of JITFunction's argument binding.
- The ops' bodies registered on the CPU and CUDA dispatch keys, and an autograd kernel
  that calls the body when nothing needs a gradient, instead of custom_op's wrappers; both
  launch a cached plan for the call first where there is one (skipping the op's checks:
  the plan's key proves them).
"""

import os

import torch
import triton
from torch.autograd import forward_ad
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from tritonblas_ops.settings import parse_bool

FAST_PATHS_ENV = "TRITONBLAS_OPS_FAST_PATHS"
ENABLED = parse_bool(FAST_PATHS_ENV, os.environ.get(FAST_PATHS_ENV, "1"))


# ---------------------------------------------------------------------------------------
# Streams and devices
# ---------------------------------------------------------------------------------------


if ENABLED and hasattr(torch._C, "_cuda_getCurrentRawStream"):  # C functions: no Python frame per call
    current_stream = torch._C._cuda_getCurrentRawStream  # (device index) -> raw stream
    current_device = torch._C._cuda_getDevice
    device_guard = torch.cuda._DeviceGuard  # (device index): that device current in the block
else:
    def current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    current_device = torch.cuda.current_device
    device_guard = torch.cuda.device


# ---------------------------------------------------------------------------------------
# Launching a compiled kernel with a kept argument list
# ---------------------------------------------------------------------------------------

# The tensors a cached launch passes, in this order; each descriptor describes one of them.
# A kernel takes those of them it names (the warp-specialized one: no pointers to A, B and C).
POINTERS = ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "counters_ptr", "partials_ptr", "budget_ptr")
DESCRIBED = {f"{t}_desc": POINTERS.index(f"{t}_ptr") for t in ("a", "b", "c", "bias")}
# Host descriptors of the Triton kernel and of the Gluon one: the same fields to the launcher.
DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)
DIRECT_LAUNCH_TRITON = "3.6."  # the launcher DirectLaunch builds arguments for
ENCODED_PER_SLOT = 8  # descriptors kept per operand, by address (a weight's never changes)


def rebased(descriptor, base: torch.Tensor | None):
    """The descriptor (one of DESCRIPTORS) over another tensor of the same layout, without
    re-validating it (a cached plan guarantees layout and alignment): a field-for-field copy,
    several times cheaper than copy.copy or the constructor (public: the constructor)."""
    copy = object.__new__(type(descriptor))
    copy.__dict__.update(descriptor.__dict__)
    copy.base = base
    return copy


def _idle(hook) -> bool:
    """No launch hook to call: None, or an empty HookChain (what Triton 3.6 holds when no
    profiler has added one: never None there)."""
    return hook is None or (isinstance(hook, _HOOK_CHAIN) and not hook.calls)


_HOOK_CHAIN = getattr(knobs, "HookChain", ())


class CompiledLaunch:
    """Launches one compiled kernel with a kept argument list, the call's tensors and alpha
    and beta put in their places: Triton's C launcher directly (DirectLaunch) when no launch
    hook would run, else CompiledKernel.run with the hooks and their metadata (a profiler)."""

    def __init__(self, kernel, arg_names: list, args: dict):
        self.kernel = kernel
        # Descriptors kept without a base: a plan keeps no tensor of the call that made it.
        self.args = [None if isinstance(value, torch.Tensor)
                     else rebased(value, None) if isinstance(value, DESCRIPTORS) else value
                     for value in (args[name] for name in arg_names)]
        slot = {name: i for i, name in enumerate(arg_names)}
        self.pointer_slots = [(index, slot[name]) for index, name in enumerate(POINTERS) if name in slot]
        self.descriptor_slots = [(slot[name], index) for name, index in DESCRIBED.items()
                                 if name in slot and self.args[slot[name]] is not None]
        self.alpha_slot, self.beta_slot = slot["alpha"], slot["beta"]
        self.direct = DirectLaunch.build(kernel, arg_names, self.args)

    def __call__(self, grid: int, stream: int, tensors: tuple, alpha: float, beta: float) -> None:
        """tensors: those of POINTERS, None for absent ones."""
        enter_hook, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _idle(enter_hook) and _idle(exit_hook):
            if self.direct is not None:
                self.direct(grid, stream, tensors, alpha, beta)
                return
            enter_hook = exit_hook = None  # no metadata to build, no hook to call
        args = self.args.copy()
        for index, slot in self.pointer_slots:
            args[slot] = tensors[index]
        args[self.alpha_slot], args[self.beta_slot] = alpha, beta
        for slot, index in self.descriptor_slots:
            args[slot] = rebased(args[slot], tensors[index])
        kernel = self.kernel
        metadata = kernel.launch_metadata((grid, 1, 1), stream, *args) if enter_hook else None
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata,
                   enter_hook, exit_hook, *args)


class DirectLaunch:
    """A compiled kernel's C launcher, called with the argument list that Triton 3.6's Python
    wrapper (CudaLauncher and wrap_handle_tensordesc) would build: tensors as their data
    pointers, each tensor descriptor expanded into its CUtensorMap, shape and strides. A
    call then skips that wrapper's walk over all the arguments, its per-descriptor Python
    and the launcher's pointer check per tensor (the call's tensors are on the plan's
    device by its key). A CUtensorMap depends only on the base address once the plan fixes
    the layout, so the last few encoded per operand are kept by address.

    build() returns None, and calls take CompiledKernel.run, on any other Triton or
    launcher shape (a kernel that needs scratch memory, a descriptor lowered otherwise)."""

    def __init__(self, launch, kernel, args, pointer_slots, descriptor_slots, scalar_slots, fill):
        self.launch = launch
        self.head = (kernel.function, kernel.run.launch_cooperative_grid, kernel.run.launch_pdl,
                     None, None, kernel.packed_metadata, None, None, None)
        self.args = args  # the expanded argument list; the call's own go into the slots
        self.pointer_slots = pointer_slots  # ((index in POINTERS, position), ...)
        self.descriptor_slots = descriptor_slots  # ((position, index in POINTERS, fill args, cache), ...)
        self.alpha_slot, self.beta_slot = scalar_slots
        self.fill = fill

    @classmethod
    def build(cls, kernel, arg_names: list, plan_args: list) -> "DirectLaunch | None":
        run = getattr(kernel, "run", None)
        launch = getattr(run, "launch", None)
        if (not triton.__version__.startswith(DIRECT_LAUNCH_TRITON) or launch is None
                or getattr(run, "global_scratch_size", 1) != 0
                or getattr(run, "profile_scratch_size", 1) != 0):
            return None
        metas = None
        if hasattr(launch, "__code__"):  # wrap_handle_tensordesc's closure over the C function
            cells = dict(zip(launch.__code__.co_freevars, launch.__closure__ or ()))
            if "launcher" not in cells or "tensordesc_meta" not in cells:
                return None
            launch, metas = cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents
        try:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        except (ImportError, AttributeError):
            return None
        args, pointer_slots, descriptor_slots, scalar_slots, described = [], [], [], [], 0
        for name, value in zip(arg_names, plan_args):
            if isinstance(value, DESCRIPTORS):
                meta = metas[described] if metas else None
                described += 1
                if meta is None or meta.get("fp4_padded"):
                    return None  # lowered to pointers, or packed: Triton's wrapper knows how
                fill_args = (meta["swizzle"], meta["elem_size"],
                             TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                             list(value.shape), list(value.strides), int(value.padding == "nan"))
                descriptor_slots.append((len(args), DESCRIBED[name], fill_args, {}))
                args += [None, *value.shape, *value.strides]
                continue
            if name in POINTERS:
                pointer_slots.append((POINTERS.index(name), len(args)))
            elif name in ("alpha", "beta"):
                scalar_slots.append(len(args))
            args.append(value)
        if metas and described != len(metas):
            return None
        return cls(launch, kernel, args, tuple(pointer_slots), tuple(descriptor_slots),
                   tuple(scalar_slots), fill)

    def __call__(self, grid: int, stream: int, tensors: tuple, alpha: float, beta: float) -> None:
        addresses = [t.data_ptr() if t is not None else None for t in tensors]
        args = self.args.copy()
        for index, slot in self.pointer_slots:
            args[slot] = addresses[index]
        for slot, index, fill_args, encoded in self.descriptor_slots:
            address = addresses[index]
            tensor_map = encoded.get(address)
            if tensor_map is None:
                tensor_map = self.fill(address, *fill_args)
                if len(encoded) >= ENCODED_PER_SLOT:
                    encoded.pop(next(iter(encoded)), None)  # the oldest
                encoded[address] = tensor_map
            args[slot] = tensor_map
        args[self.alpha_slot], args[self.beta_slot] = alpha, beta
        self.launch(grid, 1, 1, stream, *self.head, *args)


def compiled_launch(kernel, arg_names: list, args: dict) -> CompiledLaunch | None:
    """A cached launch of `kernel` (what the first launch with these arguments returned),
    or None where the fast path is off or `kernel` is not a compiled kernel."""
    if not ENABLED or kernel is None or not hasattr(kernel, "run"):
        return None
    return CompiledLaunch(kernel, arg_names, args)


# ---------------------------------------------------------------------------------------
# The ops' dispatch shortcuts
# ---------------------------------------------------------------------------------------

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BODY_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
# keyset.raw_repr() -> whether the keys below autograd lead straight to the body. Computing
# it takes three pybind calls; a call's keyset is one of a few.
_straight_to_body: dict[int, bool] = {}


def _leads_straight_to_body(keyset) -> bool:
    raw = keyset.raw_repr()
    straight = _straight_to_body.get(raw)
    if straight is None:
        straight = _straight_to_body[raw] = (
            (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _BODY_KEYS)
    return straight


def _needs_grad(args) -> bool:
    if torch.is_grad_enabled():
        for t in args:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def cached_launch_first(cached_launch, body):
    """The op's body after a cached launch (cached_launch: the output, or None where no
    plan for the call is cached; the plan's key proves the op's checks): what
    register_body and skip_autograd_without_grads take as the body. Public way, with the
    fast paths off: the body alone, behind custom_op's wrappers."""
    def cached_or_body(*args, **keyword_only_args):
        out = cached_launch(*args, **keyword_only_args)
        return body(*args, **keyword_only_args) if out is None else out

    return cached_or_body


def register_body(library: torch.library.Library, name: str, body) -> None:
    """Register the op's body as its CPU and CUDA kernel, skipping custom_op's wrapper there
    (an aliasing check, a dynamo guard, triton_op's wrapper; outputs are always fresh
    tensors, so no check is lost). These keys are reached from autograd's kernel when a
    gradient is needed and directly under torch.inference_mode. Public way, with the fast
    paths off: custom_op's own."""
    if ENABLED:
        for dispatch_key in ("CPU", "CUDA"):
            library.impl(name, body, dispatch_key)


def skip_autograd_without_grads(autograd_kernel, body):
    """The op's autograd kernel, with a shortcut: a call that needs no gradient (no input
    requires grad, no forward-mode tangent can be there) and whose keys below autograd lead
    straight to the body (no dispatch mode, subclass, functionalization or other wrapper)
    calls the body directly, skipping a re-dispatch. Public way: autograd_kernel itself."""
    if not ENABLED:
        return autograd_kernel

    def shortcut(keyset, *args, **keyword_only_args):
        if (_leads_straight_to_body(keyset) and forward_ad._current_level < 0
                and not _needs_grad(args)):
            return body(*args, **keyword_only_args)
        return autograd_kernel(keyset, *args, **keyword_only_args)

    return shortcut

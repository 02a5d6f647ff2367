"""Triton's interpreter as a kernel launcher for CPU tensors (tests, demos, CI).

The interpreter runs a kernel's programs one after another in numpy, atomics and tl.dot
included (its bf16 dot is wrong: launch.py computes bf16 from fp32 copies on the CPU).
It keeps the grid position in module state, and while an interpreted kernel runs, the
JITFunction helpers it calls must be interpreted too, which patches a process-wide class:
so one interpreted launch runs at a time, whichever thread asks (LOCK). The launch also
swaps in a dot whose sums run in K order for every output element (_k_ordered_dot).
"""

import functools
import threading
import warnings

import numpy as np

# Reentrant: launch.py holds it around a CPU launch and the counters that launch uses.
LOCK = threading.RLock()


class InterpretedKernel:
    """`jit_function` run by Triton's interpreter, indexed by grid like the jit function.

    Without TRITON_INTERPRET=1 the helpers it calls (ours and tl.cdiv's) are compiled-mode
    JITFunctions, whose __call__ only raises; while the kernel runs, they are interpreted too.
    """

    def __init__(self, jit_function):
        from triton.runtime.interpreter import InterpretedFunction

        _check_numpy()
        self._kernel = InterpretedFunction(jit_function.fn)
        self._helpers = {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.interpreter import InterpreterBuilder
            from triton.runtime.jit import JITFunction

            with LOCK:
                compiled_call, numpy_dot = JITFunction.__call__, InterpreterBuilder.create_dot
                JITFunction.__call__ = self._interpreted_call
                InterpreterBuilder.create_dot = _k_ordered_dot(numpy_dot)
                try:
                    # inf - inf, 0 * inf and overflow are the IEEE results the GPU gives too;
                    # numpy would warn about each one.
                    with np.errstate(all="ignore"), warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        self._kernel[grid](*args, **kwargs)
                finally:
                    JITFunction.__call__, InterpreterBuilder.create_dot = compiled_call, numpy_dot

        return run

    @property
    def _interpreted_call(self):
        """JITFunction.__call__ while a launch runs: a plain function (a bound method set on
        the class would not receive the JITFunction as its first argument)."""
        from triton.runtime.interpreter import InterpretedFunction

        helpers = self._helpers

        def interpreted_call(jit_fn, *args, **kwargs):
            # Keyed by id: hashing a JITFunction would parse its source.
            if id(jit_fn) not in helpers:
                helpers[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
            # rewrite() rather than __call__: __call__ patches triton.language and never
            # restores it, which breaks every later compile in the process. The launch's own
            # patch (restored when it ends) covers tl and tl.core (kernel._TL_CORE).
            return helpers[id(jit_fn)].rewrite()(*args, **kwargs)

        return interpreted_call


def _k_ordered_dot(numpy_dot):
    """The interpreter's tl.dot with one summation order for every output element: the
    products, rounded to the accumulator's dtype, added up in K order, then the accumulator.
    numpy's matmul hands fp32 to BLAS, whose order depends on an element's place in its
    micro-kernel and on the operands' layouts (OpenBLAS on an AMD EPYC: the transposed
    problem's bits differ), where wgmma's depends on K alone, as batch invariance needs."""
    from triton.runtime.interpreter import TensorHandle

    def create_dot(builder, a, b, d, *args):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return numpy_dot(builder, a, b, d, *args)
        acc_dtype = d.data.dtype
        products = a.data.astype(acc_dtype)[:, :, None] * b.data.astype(acc_dtype)[None, :, :]
        total = products[:, 0, :].copy()
        for k in range(1, products.shape[1]):
            total += products[:, k, :]
        return TensorHandle(total + d.data, d.dtype.scalar)

    return create_dot


def _check_numpy() -> None:
    """Triton 3.6's interpreter turns a one-element array into a loop bound with int(),
    which numpy 2.4 refuses for arrays of one dimension (Triton 3.7 squeezes it first)."""
    import triton

    old_triton = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7)
    if old_triton and tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
        raise RuntimeError(
            f"tritonblas_ops runs CPU tensors through Triton's interpreter, which in Triton "
            f"{triton.__version__} does not work with numpy {np.__version__}: install "
            f"numpy<2.4 or triton>=3.7 (GPU tensors are not affected)"
        )


@functools.cache
def interpreted(jit_function) -> InterpretedKernel:
    """The interpreted twin of a jit function, made once per process (two threads racing
    here may each make one: equal and stateless but for a cache, so either serves)."""
    return InterpretedKernel(jit_function)

"""Epilogue fusion under torch.compile (settings' fuse_epilogues, off by default): a routed
GEMM and the activation that is its only reader become one torch.ops.tritonblas.ws_mm_act
call, whose kernel applies the activation in its epilogue; and a gated linear unit's
act(gate) * (x @ w_up), the GEMM's output read only by the product, becomes one
ws_mm_gated call, whose epilogue multiplies by the activated gate; so does a training
backward's GELU or SiLU backward of a GEMM's output (the gradient into the activation),
whose epilogue multiplies by the activation's slope at the saved pre-activation. A GEMM's
output added to a tensor (a residual), multiplied or divided by a number (a scale), or
both (LoRA's base(x) + up(down(x)) * scaling), becomes ws_mm_act(a, b, addend,
activation="none", alpha=scale); a scaled addmm, addmm with beta and alpha the scale.

A post-grad pass, run by lowering's cache-key pass (so the setting is in the compiled-code
cache keys). Post-grad graphs hold activations as Inductor's decompositions leave them
(GELU's tanh form is eight pointwise nodes), so the patterns are traced through the same
decompositions, as Inductor traces its own (`pattern_matcher.gen_pattern`), once per
dtype: mm(a, b), addmm(bias, a, b) or mm(a, b) + bias, perhaps viewed (an nn.Linear on
3-D input views its 2-D GEMM back), then relu, gelu, gelu(approximate="tanh") or silu.
The pattern matcher replaces a match only where no node outside it reads the GEMM's
output: in a training graph the forward's GEMM output is saved for the backward, so those
GEMMs stay unfused (the op would have to write the pre-activation as well), except before
a ReLU, whose backward reads the boolean mask the forward saved instead.
"""

import functools
import itertools
import threading

import torch
from torch._inductor import pattern_matcher

from tritonblas_ops import activations, settings
from tritonblas_ops.activations import ACTIVATIONS
from tritonblas_ops.ops import SUPPORTED_DTYPES, bias_broadcasts

FUSED = [name for name in ACTIVATIONS if name != "none"]  # the activations a pattern ends in


# The output-sized memory passes a fused epilogue saves (policy.py): an activation's,
# gated product's or activation backward's pointwise kernel read the GEMM's output and
# wrote its own; a residual add, which Inductor may fold into the next kernel, at least one.
# An activation read only by pointwise ops saves none: Inductor computes it in their kernel.
SAVED_BY_POINTWISE = 2
SAVED_BY_RESIDUAL = 1


def fuse(graph: torch.fx.Graph) -> int:
    """Replace every fusable gated product, then every GEMM + activation, then every GEMM +
    (scaled) residual, then every scaled GEMM of a post-grad graph; returns how many. Gated
    first: a GLU's gate GEMM also matches GEMM + activation, and fusing that would leave the
    product's kernel in place; residual after activations: an activation's bias added after
    the GEMM would also match it; a scaled residual before its scale alone, which would
    leave the add's kernel."""
    state = settings.current()
    if not (state.enabled and state.fuse_epilogues):
        return 0
    return sum(patterns.apply(graph) for patterns in _patterns())


def _routes(a, b, bias, saved_passes: int = SAVED_BY_POINTWISE, read_passes: int = 0) -> bool:
    """Whether routing takes this GEMM with an epilogue fused into it (lowering's rules, on
    the nodes' example values): the fused op must not take a GEMM that routing would leave
    to Inductor. `read_passes`: the output-sized operands the epilogue reads (a gate, a
    residual); a bias of the output's size counts as one."""
    from tritonblas_ops import lowering  # imports this module

    values = [node.meta.get("val") for node in (a, b, bias) if node is not None]
    if not all(isinstance(v, torch.Tensor) for v in values) or values[0].dim() != 2 or values[1].dim() != 2:
        return False
    (m, k), n = values[0].shape, values[1].shape[1]
    if bias is not None and not bias_broadcasts(values[2].shape, (m, n)):
        return False  # an add of another shape after the GEMM: not an epilogue's bias
    if bias is not None and values[2].numel() == m * n:
        read_passes += 1
    m, n, k = (_hint(size) for size in (m, n, k))
    # A size without a hint counts as 0: nothing routed.
    return lowering.routable([v.device for v in values], [v.dtype for v in values], 1, m, n, k,
                             saved_passes=saved_passes, read_passes=read_passes)


def _hint(size) -> int:
    """An int size, or a SymInt's hint (0 where it has none)."""
    if isinstance(size, int):
        return size
    return getattr(size.node, "hint", None) or 0


def _fusable(match: pattern_matcher.Match) -> bool:
    saved = 0 if _read_only_by_pointwise(match.output_node()) else SAVED_BY_POINTWISE
    return _routes(match.kwargs["a"], match.kwargs["b"], match.kwargs.get("bias"), saved_passes=saved)


def _read_only_by_pointwise(node: torch.fx.Node) -> bool:
    """Whether every reader of an activation's output (through views) is a pointwise op:
    Inductor then computes the activation inside its readers' kernel, so fusing it into the
    GEMM saves no memory pass (SwiGLU's silu(gate), read by the product whose gated fusion
    routing declined)."""
    readers = list(node.users)
    for reader in readers:
        target = reader.target
        if reader.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return False
        if target.is_view or target is torch.ops.aten._unsafe_view.default:
            if not _read_only_by_pointwise(reader):
                return False
        elif torch.Tag.pointwise not in target.tags:
            return False
    return bool(readers)


def _gated_fusable(match: pattern_matcher.Match) -> bool:
    """Routing takes the GEMM, and the gate has the product's shape (viewed or not) and dtype."""
    gate = match.kwargs["gate"].meta.get("val")
    out = match.output_node().meta.get("val")
    a = match.kwargs["a"].meta.get("val")
    return (_routes(match.kwargs["a"], match.kwargs["b"], None, read_passes=1) and isinstance(gate, torch.Tensor)
            and isinstance(out, torch.Tensor) and gate.shape == out.shape and gate.dtype == a.dtype)


def _replace_with_gated(activation: str, viewed: bool):
    """act(gate) * mm(a, b) (perhaps viewed) becomes ws_mm_gated(a, b, gate), the gate read
    in the product's 2-D shape."""
    def replace(match: pattern_matcher.Match, *args, **kwargs) -> None:
        gate = _read_as_product(match, kwargs["gate"]) if viewed else kwargs["gate"]
        _substitute(match, torch.ops.tritonblas.ws_mm_gated.default, (kwargs["a"], kwargs["b"], gate),
                    {"activation": activation}, viewed)

    return replace


def _replace_with_op(activation: str, viewed: bool):
    def replace(match: pattern_matcher.Match, *args, **kwargs) -> None:
        _substitute(match, torch.ops.tritonblas.ws_mm_act.default,
                    (kwargs["a"], kwargs["b"], kwargs.get("bias")), {"activation": activation}, viewed)

    return replace


def _substitute(match: pattern_matcher.Match, op, args: tuple, kwargs: dict, viewed: bool) -> None:
    """The match's output replaced by op(*args, **kwargs), which gives the GEMM's 2-D output:
    viewed as the pattern viewed the GEMM's, where it did."""
    out = match.output_node()
    graph = match.graph
    with graph.inserting_before(out):
        fused = graph.call_function(op, args, kwargs)
        if viewed:
            view = _matched_view(match)
            fused.meta["val"] = view.args[0].meta["val"]
            fused = graph.call_function(view.target, (fused, view.args[1]))
    fused.meta.update(out.meta)
    out.replace_all_uses_with(fused)
    match.erase_nodes()


def _read_as_product(match: pattern_matcher.Match, operand: torch.fx.Node) -> torch.fx.Node:
    """An operand of the viewed product's shape, reshaped to the GEMM's 2-D output shape
    (before the match's output), as the fused op's epilogue reads it."""
    product = _matched_view(match).args[0].meta["val"]
    with match.graph.inserting_before(match.output_node()):
        reshaped = match.graph.call_function(torch.ops.aten.reshape.default, (operand, list(product.shape)))
    reshaped.meta["val"] = operand.meta["val"].reshape(product.shape)
    return reshaped


def _matched_view(match: pattern_matcher.Match) -> torch.fx.Node:
    return next(node for node in match.nodes if node.target in _VIEWS)


def _matched_mm(match: pattern_matcher.Match) -> torch.fx.Node:
    return next(node for node in match.nodes if node.target == torch.ops.aten.mm.default)


# Tracing spells the view aten.view; post-grad graphs hold it as aten.reshape (Inductor's
# view_to_reshape runs before custom passes).
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _also_reshape(pattern: pattern_matcher.PatternExpr) -> None:
    """Make the traced pattern's view node match either spelling of the view."""
    if isinstance(pattern, pattern_matcher.CallFunction):
        if torch.ops.aten.view.default in pattern.fns:
            pattern.fns = list(_VIEWS)
            pattern.fns_set = type(pattern.fns_set)(_VIEWS)
        for arg in pattern.args:
            _also_reshape(arg)


_lock = threading.Lock()
_built: tuple | None = None


def _patterns() -> tuple:
    """The gated, the activation, the residual and the scale patterns, traced on first use
    (every activation, with and without a bias, for each dtype, whose decompositions may
    differ): once, whichever thread compiles first."""
    global _built
    with _lock:
        if _built is None:
            _built = (_trace_gated_patterns(), _trace_patterns(), _trace_residual_patterns(),
                      _trace_scale_patterns())
        return _built


def _searches(apply, view):
    """The search functions of one activation (their parameters name the pattern's inputs):
    with addmm's bias, with a bias added after mm (Inductor unfuses fp32 addmm so on GPUs
    when every reader is pointwise), without one; `view` is applied to the GEMM's output
    before the activation (the identity, or the view back to a Linear's leading dimensions:
    its sizes are a list, which the traced pattern matches whatever they are)."""
    def addmm_bias(a, b, bias):
        return apply(view(torch.addmm(bias, a, b)))

    def added_bias(a, b, bias):
        return apply(view(torch.mm(a, b) + bias))

    def without_bias(a, b):
        return apply(view(torch.mm(a, b)))

    return addmm_bias, added_bias, without_bias


def _variants():
    """(activation, viewed, apply, view) for every fused activation, the GEMM's output viewed
    (to the leading dimensions of a Linear on 3-D input: the traced pattern matches any
    sizes) or not."""
    for activation, viewed in itertools.product(FUSED, (False, True)):
        apply = functools.partial(activations.apply, activation=activation)
        yield activation, viewed, apply, _view(viewed)


def _register(patterns, search, example: tuple, viewed: bool, extra_check, replace) -> None:
    """Trace `search` on `example` through Inductor's decompositions, as its own patterns are."""
    pattern = pattern_matcher.gen_pattern(search, example, pattern_matcher.fwd_only)
    if viewed:
        _also_reshape(pattern)
    pattern_matcher.register_graph_pattern(pattern, extra_check=extra_check, pass_dict=patterns)(replace)


def _trace_patterns() -> pattern_matcher.PatternMatcherPass:
    patterns = pattern_matcher.PatternMatcherPass()
    for activation, viewed, apply, view in _variants():
        addmm_bias, added_bias, without_bias = _searches(apply, view)
        for dtype in SUPPORTED_DTYPES:
            a, b, bias = (torch.empty(shape, dtype=dtype) for shape in ((8, 16), (16, 8), (8,)))
            for search, example in ((addmm_bias, (a, b, bias)), (added_bias, (a, b, bias)),
                                    (without_bias, (a, b))):
                _register(patterns, search, example, viewed, _fusable, _replace_with_op(activation, viewed))
    return patterns


def _gated_searches(apply, view):
    """The search functions of one gated activation, either operand order (their
    parameters name the pattern's inputs)."""
    def gate_first(a, b, gate):
        return apply(gate) * view(torch.mm(a, b))

    def product_first(a, b, gate):
        return view(torch.mm(a, b)) * apply(gate)

    return gate_first, product_first


# An activation's backward as AOTAutograd writes it, by the slope ws_mm_gated multiplies with.
_BACKWARDS = {
    "d_gelu": lambda grad, x: torch.ops.aten.gelu_backward(grad, x),
    "d_gelu_tanh": lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
    "d_silu": lambda grad, x: torch.ops.aten.silu_backward(grad, x),
}


def _slope_searches():
    """(slope, viewed, search) of every activation's backward whose incoming gradient is a
    GEMM's output, perhaps viewed (the backward of a Linear on 3-D input)."""
    for slope, viewed in itertools.product(activations.SLOPES, (False, True)):
        yield slope, viewed, _slope_search(_BACKWARDS[slope], viewed)


def _slope_search(backward, viewed: bool):
    """The search function (its parameters name the pattern's inputs)."""
    def search(a, b, gate):
        product = torch.mm(a, b)
        return backward(product.view(2, 4, 8) if viewed else product, gate)

    return search


def _trace_gated_patterns() -> pattern_matcher.PatternMatcherPass:
    """act(gate) * mm(a, b), either operand order, the product perhaps viewed (nn.Linear on
    3-D input), for every activation and dtype: SwiGLU's silu(gate(x)) * up(x), GeGLU's;
    and an activation's backward of a GEMM's output (the backward GEMM into a GELU or
    SiLU), which is the product times the activation's slope at the gate (not ReLU's,
    which reads the boolean mask its forward saved)."""
    patterns = pattern_matcher.PatternMatcherPass()
    searches = [(activation, viewed, search) for activation, viewed, apply, view in _variants()
                for search in _gated_searches(apply, view)]
    for activation, viewed, search in searches + list(_slope_searches()):
        for dtype in SUPPORTED_DTYPES:
            example = (torch.empty(8, 16, dtype=dtype), torch.empty(16, 8, dtype=dtype),
                       torch.empty((2, 4, 8) if viewed else (8, 8), dtype=dtype))
            _register(patterns, search, example, viewed, _gated_fusable, _replace_with_gated(activation, viewed))
    return patterns


def _residual_fusable(viewed: bool, scaled: bool = False):
    """The addend can be the epilogue's bias: a tensor of the product's dtype and device that
    broadcasts to its (M, N) shape, or, behind the view, one of the view's full shape (read
    back in (M, N)); nothing else reads the product (the matcher's rule); `scaled`: the
    product's scale is a number (_scale_of)."""
    def check(match: pattern_matcher.Match) -> bool:
        if scaled and _scale_of(match) is None:
            return False
        addend = match.kwargs["addend"]
        value = addend.meta.get("val") if isinstance(addend, torch.fx.Node) else None
        a = match.kwargs["a"].meta.get("val")
        out = match.output_node().meta.get("val")
        if not (isinstance(value, torch.Tensor) and isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
            return False
        if value.dtype != a.dtype or out.dtype != a.dtype or value.device != a.device:
            return False
        product = _matched_view(match) if viewed else _matched_mm(match)
        if out.shape != product.meta["val"].shape:
            return False  # the addend broadened the product
        if viewed and value.shape != out.shape and value.dim() > 1:
            return False  # only a full addend is read back in (M, N)
        return _routes(match.kwargs["a"], match.kwargs["b"], None, SAVED_BY_RESIDUAL,
                       read_passes=int(value.numel() == out.numel()))

    return check


def _replace_with_residual(viewed: bool, scaled: bool = False):
    """mm(a, b) + addend (perhaps viewed; `scaled`: the product scaled first) becomes
    ws_mm_act(a, b, addend, activation="none", alpha=scale), a full-shape addend behind the
    view read in the product's 2-D shape."""
    def replace(match: pattern_matcher.Match, *args, **kwargs) -> None:
        addend = kwargs["addend"]
        if viewed and addend.meta["val"].dim() > 1:
            addend = _read_as_product(match, addend)
        alpha = _scale_of(match) if scaled else 1.0
        _substitute(match, torch.ops.tritonblas.ws_mm_act.default, (kwargs["a"], kwargs["b"], addend),
                    {"activation": "none", **({"alpha": alpha} if alpha != 1 else {})}, viewed)

    return replace


def _residual_searches(product):
    """The search functions of a residual add, either order (their parameters name the
    pattern's inputs); `product(a, b)`: the GEMM's output as the add reads it."""
    def product_first(a, b, addend):
        return product(a, b) + addend

    def addend_first(a, b, addend):
        return addend + product(a, b)

    return product_first, addend_first


def _trace_residual_patterns() -> pattern_matcher.PatternMatcherPass:
    """mm(a, b) + addend, either order, the product perhaps viewed and perhaps scaled first
    (those registered first: the unscaled pattern would also match a scaled product's add,
    with the other operand as its GEMM): a residual connection after a projection (or a bias
    Inductor left apart from its GEMM, or LoRA's scaled update), for every dtype."""
    patterns = pattern_matcher.PatternMatcherPass()
    for scaled, viewed in itertools.product((True, False), (False, True)):
        view = _view(viewed)
        products = ([_product_search(scale, view) for scale in _SCALE_SEARCHES] if scaled
                    else [_product_search(lambda x: x, view)])
        for dtype, product in itertools.product(SUPPORTED_DTYPES, products):
            for search in _residual_searches(product):
                example = (torch.empty(8, 16, dtype=dtype), torch.empty(16, 8, dtype=dtype),
                           torch.empty((2, 4, 8) if viewed else (8, 8), dtype=dtype))
                _register(patterns, search, example, viewed, _residual_fusable(viewed, scaled),
                          _replace_with_residual(viewed, scaled))
    return patterns


def _view(viewed: bool):
    """The view a pattern applies to the GEMM's output (a Linear's on 3-D input), or none."""
    return (lambda x: x.view(2, 4, 8)) if viewed else (lambda x: x)


# A scale as a model writes one; the traced pattern matches any number in its place.
_SCALE_SEARCHES = (lambda x: x * 0.5, lambda x: x / 4)
_SCALES = (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)


def _scale_of(match: pattern_matcher.Match) -> float | None:
    """The match's scale as the epilogue's alpha (a multiplier, or one over a divisor), or
    None unless it is a Python number (a tensor, a bool or a zero divisor is not fused)."""
    node = next(node for node in match.nodes if node.target in _SCALES)
    factor = node.args[1]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return None
    if node.target is torch.ops.aten.div.Tensor:
        return 1.0 / factor if factor != 0 else None
    return float(factor)


def _scale_fusable(match: pattern_matcher.Match) -> bool:
    """The scale is a number and routing takes the GEMM (with its bias); it saves passes as
    an activation does (nothing where only pointwise ops read the scaled output: Inductor
    computes the scale in their kernel)."""
    saved = 0 if _read_only_by_pointwise(match.output_node()) else SAVED_BY_POINTWISE
    return _scale_of(match) is not None and _routes(match.kwargs["a"], match.kwargs["b"], match.kwargs.get("bias"),
                                                    saved_passes=saved)


def _replace_with_scaled(viewed: bool):
    """mm(a, b) * scale (perhaps viewed) becomes ws_mm_act(a, b, None, activation="none",
    alpha=scale); addmm(bias, a, b) * scale becomes addmm(bias, a, b, beta=scale,
    alpha=scale), which routing lowers to ws_addmm (torch.addmm's own scales)."""
    def replace(match: pattern_matcher.Match, *args, **kwargs) -> None:
        scale = _scale_of(match)
        if "bias" in kwargs:
            _substitute(match, torch.ops.aten.addmm.default, (kwargs["bias"], kwargs["a"], kwargs["b"]),
                        {"beta": scale, "alpha": scale}, viewed)
        else:
            _substitute(match, torch.ops.tritonblas.ws_mm_act.default, (kwargs["a"], kwargs["b"], None),
                        {"activation": "none", "alpha": scale}, viewed)

    return replace


def _trace_scale_patterns() -> pattern_matcher.PatternMatcherPass:
    """mm(a, b) or addmm(bias, a, b), times or over a number, the product perhaps viewed, for
    every dtype: a scaled projection (muP's output multiplier, an attention-style
    1/sqrt(d)), with a Linear's bias or without."""
    patterns = pattern_matcher.PatternMatcherPass()
    for viewed, scale, dtype in itertools.product((False, True), _SCALE_SEARCHES, SUPPORTED_DTYPES):
        a, b, bias = torch.empty(8, 16, dtype=dtype), torch.empty(16, 8, dtype=dtype), torch.empty(8, dtype=dtype)
        _register(patterns, _product_search(scale, _view(viewed)), (a, b), viewed, _scale_fusable,
                  _replace_with_scaled(viewed))
        _register(patterns, _biased_search(scale, _view(viewed)), (a, b, bias), viewed, _scale_fusable,
                  _replace_with_scaled(viewed))
    return patterns


def _biased_search(finish, view):
    """The search function of finish(view(addmm(bias, a, b))) (its parameters name the
    pattern's inputs)."""
    def search(a, b, bias):
        return finish(view(torch.addmm(bias, a, b)))

    return search


def _product_search(finish, view):
    """The search function of finish(view(mm(a, b))) (its parameters name the pattern's inputs)."""
    def search(a, b):
        return finish(view(torch.mm(a, b)))

    return search

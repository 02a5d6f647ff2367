"""The activations a ws GEMM's epilogue can apply (kernel._activation), in torch: for the
outcomes that launch nothing (K = 0), for the fused op's backward, and for tests."""

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
# The activations' slopes, as gate functions only: d_gelu(h) * (dy @ w) is GELU's backward
# whose incoming gradient is a GEMM's output (h: the pre-activation). Not ReLU's: its
# backward reads the boolean mask the forward saved.
SLOPES = ("d_gelu", "d_gelu_tanh", "d_silu")
GATE_FUNCTIONS = ACTIVATIONS + SLOPES
# What a launch's epilogue may do: an activation of the product (plus bias), or, gated, the
# product times a gate function of the bias operand, the gate (a GLU: SwiGLU is "gate_silu").
GATE_PREFIX = "gate_"
EPILOGUES = ACTIVATIONS + tuple(GATE_PREFIX + name for name in GATE_FUNCTIONS)


def split_epilogue(epilogue: str) -> tuple[str, bool]:
    """(activation, gated) of an epilogue name."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    gated = epilogue.startswith(GATE_PREFIX)
    return (epilogue[len(GATE_PREFIX):] if gated else epilogue), gated


def epilogue(product: torch.Tensor, bias: torch.Tensor | None, beta: float, name: str) -> torch.Tensor:
    """What a launch's epilogue makes of a product (already scaled by alpha), in torch."""
    activation, gated = split_epilogue(name)
    if gated:
        return apply(bias, activation) * product
    return apply(product + beta * bias if bias is not None else product, activation)


def apply(x: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(x), as torch.nn.functional defines it (a slope: its activation's
    derivative)."""
    if activation in SLOPES:
        return derivative(x, activation.removeprefix("d_"))
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    if activation == "none":
        return x
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def derivative(x: torch.Tensor, activation: str) -> torch.Tensor:
    """d activation / dx at x (relu's at 0 is 0, as autograd's; a slope's: its activation's
    second derivative)."""
    if activation in SLOPES:
        return _second_derivative(x, activation.removeprefix("d_"))
    if activation == "relu":
        return (x > 0).to(x.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if activation == "gelu_tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        tanh = torch.tanh(inner)
        return 0.5 * (1 + tanh) + 0.5 * x * (1 - tanh**2) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x**2)
    if activation == "silu":
        sigmoid = torch.sigmoid(x)
        return sigmoid * (1 + x * (1 - sigmoid))
    if activation == "none":
        return torch.ones_like(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _second_derivative(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (2 - x * x)
    if activation == "gelu_tanh":
        c, a = math.sqrt(2 / math.pi), 0.044715
        tanh = torch.tanh(c * (x + a * x**3))
        inner_slope = c * (1 + 3 * a * x * x)
        return (1 - tanh**2) * (inner_slope + 0.5 * x * (6 * a * c * x - 2 * tanh * inner_slope**2))
    if activation == "silu":
        sigmoid = torch.sigmoid(x)
        return sigmoid * (1 - sigmoid) * (2 + x * (1 - 2 * sigmoid))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")

"""The activations a ws GEMM's epilogue can apply (kernel._activation), in torch: for the
outcomes that launch nothing (K = 0), for the fused op's backward, and for tests."""

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
# What a launch's epilogue may do: an activation of the product (plus bias), or, gated, the
# product times an activation of the bias operand, the gate (a GLU: SwiGLU is "gate_silu").
GATE_PREFIX = "gate_"
EPILOGUES = ACTIVATIONS + tuple(GATE_PREFIX + name for name in ACTIVATIONS)


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
    """activation(x), as torch.nn.functional defines it."""
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
    """d activation / dx at x (relu's at 0 is 0, as autograd's)."""
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

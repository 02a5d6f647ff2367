"""Epilogue fusion under torch.compile (tritonblas_ops/fusion.py): which pointwise work after a
routed GEMM goes into its epilogue (activations, gated products, activation backwards,
residual adds, scales), with eager's values and fewer generated kernels.

On the CPU (the `cpu_routing` fixture) compiled code calls the fused ops, which run the
kernel through Triton's interpreter; the inline form's code is checked against a stand-in
CUDA target. The `gpu` tests run both forms for real.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import tritonblas_ops
from tritonblas_ops import activations, settings
from tritonblas_ops import lowering as R
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches, rel_error
from compiled import (  # noqa: F401  (fresh_state and cpu_routing: fixtures)
    compile_and_run, cpu_routing, fresh_state, generated_code_only, randn, routed_calls)


CPP_KERNEL = re.compile(r"^cpp_fused_\w+ = ", re.MULTILINE)  # a pointwise kernel Inductor generated
CPP_CALL = re.compile(r"^\s+cpp_fused_\w+\((.*)\)$", re.MULTILINE)  # a call of one


def kernel_arguments(code: str) -> int:
    """The buffers the generated C++ kernels of a module take, summed over their calls."""
    return sum(len(arguments.split(",")) for arguments in CPP_CALL.findall(code))


class MLP(torch.nn.Module):
    """GPT-2's MLP (bias, tanh GELU) and a bias-free SiLU gate, as Llama's."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)
        self.gate = torch.nn.Linear(16, 24, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh")) + F.silu(self.gate(x)).mean(-1, keepdim=True)


@pytest.mark.parametrize("leading", [(32,), (2, 16)])
def test_fused_epilogues_replace_a_gemm_and_its_activation(cpu_routing, leading):
    """fuse_epilogues(True): each GEMM whose only reader is its activation becomes one
    ws_mm_act call (the bias too), Inductor generates fewer pointwise kernels, the result
    is eager's within fp32 tolerance and bitwise the same run to run. Off, the GEMMs are
    routed as usual and the activations are Inductor's kernels. With 3-D input the
    activation reads the GEMM through a view back to (batch, sequence, features): fused
    too, the view applied to the op's output."""
    torch.manual_seed(0)
    fused_code = check_fusion(MLP(), randn(*leading, 16), ["ws_addmm", "ws_addmm", "ws_mm"],
                              ["ws_addmm", "ws_mm_act", "ws_mm_act"])
    assert "activation='gelu_tanh'" in fused_code and "activation='silu'" in fused_code


def check_fusion(module, x, plain_calls: list, fused_calls: list) -> str:
    """Compiled without and with fuse_epilogues (no grad): the routed calls each way, fewer
    C++ kernels fused, both within fp32 tolerance of float64, fused bitwise run to run.
    Returns the fused code."""
    with torch.no_grad():
        plain, plain_code = compile_and_run(module, x)
        tritonblas_ops.fuse_epilogues(True)
        fused, fused_code = compile_and_run(module, x)
        again, _ = compile_and_run(module, x)
        reference = module.double()(x.double())
    assert sorted(routed_calls(plain_code)) == plain_calls
    assert sorted(routed_calls(fused_code)) == fused_calls
    assert len(CPP_KERNEL.findall(fused_code)) < len(CPP_KERNEL.findall(plain_code))
    assert_matches(fused, reference, REL_TOLERANCE[torch.float32])
    assert_matches(plain, reference, REL_TOLERANCE[torch.float32])
    assert torch.equal(fused, again)
    return fused_code


class GLU(torch.nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x)), the product in either order."""

    def __init__(self, activation="silu", gate_first=True):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(16, 40, bias=False), torch.nn.Linear(16, 40, bias=False)
        self.down = torch.nn.Linear(40, 16, bias=False)
        self.activation, self.gate_first = activation, gate_first

    def forward(self, x):
        gate, up = activations.apply(self.gate(x), self.activation), self.up(x)
        return self.down(gate * up if self.gate_first else up * gate)


@pytest.mark.parametrize("activation,gate_first", [("silu", True), ("silu", False), ("gelu_tanh", True)])
@pytest.mark.parametrize("leading", [(32,), (2, 16)])
def test_fused_glu_becomes_one_gated_gemm(cpu_routing, leading, activation, gate_first):
    """fuse_epilogues(True): a GLU's act(gate) * up becomes ws_mm_gated(x, w_up, gate): the
    up GEMM's epilogue multiplies by the activated gate, and the product's pointwise kernel
    is gone (not the gate GEMM's activation fused instead, which would leave it). Eager's
    values within fp32 tolerance, bitwise run to run; 2-D and 3-D input."""
    torch.manual_seed(0)
    fused_code = check_fusion(GLU(activation, gate_first), randn(*leading, 16), ["ws_mm", "ws_mm", "ws_mm"],
                              ["ws_mm", "ws_mm", "ws_mm_gated"])
    assert f"activation='{activation}'" in fused_code


@pytest.mark.parametrize("leading", [(32,), (2, 16)])
def test_an_activation_read_only_by_pointwise_ops_saves_no_pass(cpu_routing, monkeypatch, leading):
    """What policy "auto" is told a fused activation saves: nothing where only pointwise ops
    read it (a GLU's activated gate, its gated fusion declined: Inductor computes the
    activation in the product's kernel anyway), two passes where it is written for a GEMM
    (GPT-2's GELU, read by the next linear) or a reduction."""
    asked = []

    def faster(device, dtype, batches, m, n, k, *, saved_passes=0, read_passes=0, **_):
        asked.append((n, saved_passes, read_passes))
        return saved_passes > 0 and read_passes == 0  # fusions that save a pass; no gated one

    monkeypatch.setattr(R.policy, "faster", faster)
    tritonblas_ops.set_policy("auto")
    tritonblas_ops.fuse_epilogues(True)
    with torch.no_grad():
        _, glu_code = compile_and_run(GLU("silu"), randn(*leading, 16))
        assert routed_calls(glu_code) == [] and (40, 0, 0) in asked and (40, 2, 0) not in asked
        _, mlp_code = compile_and_run(MLP(), randn(*leading, 16))
    assert sorted(routed_calls(mlp_code)) == ["ws_mm_act", "ws_mm_act"]


class Activation(torch.nn.Module):
    def __init__(self, activation: str):
        super().__init__()
        self.activation = activation

    def forward(self, x):
        return activations.apply(x, self.activation)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "silu"])
@pytest.mark.parametrize("leading", [(32,), (2, 16)])
def test_a_training_backward_fuses_the_activations_backward(cpu_routing, leading, activation):
    """fuse_epilogues(True) on a training step: the backward's GEMM into the activation and
    the activation's backward become one ws_mm_gated(dy, w, h, activation="d_<act>"), h the
    saved pre-activation; the generated C++ kernels read fewer buffers (torch 2.14 fuses the
    activation's backward with a bias gradient's sum, so their number stays); gradients
    within fp32 tolerance of float64 and bitwise run to run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), Activation(activation), torch.nn.Linear(48, 16))
    x = randn(*leading, 16)

    def step(compiled):
        model.zero_grad()
        out, codes = run_and_get_code(lambda: compiled(x).square().sum().backward())
        return [p.grad.clone() for p in model.parameters()], codes[-1]

    torch._dynamo.reset()
    plain, plain_backward = step(torch.compile(model))
    tritonblas_ops.fuse_epilogues(True)
    torch._dynamo.reset()
    fused, fused_backward = step(torch.compile(model))
    again, _ = step(torch.compile(model))
    # Two weight gradients and the gradient into the activation (x needs none).
    assert sorted(routed_calls(plain_backward)) == ["ws_mm"] * 3
    assert sorted(routed_calls(fused_backward)) == ["ws_mm"] * 2 + ["ws_mm_gated"]
    assert f"activation='d_{activation}'" in fused_backward
    assert kernel_arguments(fused_backward) < kernel_arguments(plain_backward)
    reference = copy.deepcopy(model).double()
    reference(x.double()).square().sum().backward()
    for got, unfused, want in zip(fused, plain, reference.parameters()):
        assert_matches(got, want.grad, REL_TOLERANCE[torch.float32])
        assert_matches(unfused, want.grad, REL_TOLERANCE[torch.float32])
    assert all(torch.equal(g, a) for g, a in zip(fused, again))


class Residual(torch.nn.Module):
    """Two projections whose outputs are added to the residual stream, as a transformer
    block's attention output and MLP down projections are."""

    def __init__(self):
        super().__init__()
        self.o, self.down = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(48, 16, bias=False)
        self.up = torch.nn.Linear(16, 48, bias=False)

    def forward(self, x):
        h = x + self.o(x)
        return self.down(self.up(h).relu()) + h


def test_residual_adds_go_into_the_gemms_epilogue(cpu_routing):
    """On 3-D input (where the view keeps Inductor from making mm + add an addmm itself),
    a projection's output added to the residual stream becomes ws_mm_act(x, w, residual,
    activation="none"), in the forward and in a training step's backward (gradients summed
    into a GEMM's); fewer C++ kernels; float64's values within fp32 tolerance."""
    torch.manual_seed(0)
    x = randn(2, 16, 16)
    fused_code = check_fusion(Residual(), x, ["ws_mm", "ws_mm", "ws_mm"],
                              ["ws_mm_act", "ws_mm_act", "ws_mm_act"])
    assert fused_code.count("activation='none'") == 2
    model = Residual()
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: torch.compile(model)(x).square().sum().backward())
    assert "activation='none'" in codes[-1]
    reference = copy.deepcopy(model).double()
    reference(x.double()).square().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_matches(got.grad, want.grad, REL_TOLERANCE[torch.float32])


class Scaled(torch.nn.Module):
    """A LoRA-adapted projection as PEFT computes it, base(x) + up(down(x)) * scaling, and a
    projection divided by a number on its way out."""

    def __init__(self):
        super().__init__()
        self.base, self.down = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 4, bias=False)
        self.up, self.head = torch.nn.Linear(4, 24, bias=False), torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.head(self.base(x) + self.up(self.down(x)) * 2.0) / 4


# input's leading dimensions: the routed calls without and with fusion. On 2-D input
# Inductor makes the base GEMM and the add an addmm itself, the scaled update its bias.
SCALED_CASES = {(32,): (["ws_addmm", "ws_mm", "ws_mm", "ws_mm"], ["ws_addmm", "ws_mm", "ws_mm_act", "ws_mm_act"]),
                (2, 16): (["ws_mm"] * 4, ["ws_mm", "ws_mm", "ws_mm_act", "ws_mm_act"])}


@pytest.mark.parametrize("leading", list(SCALED_CASES))
def test_scales_go_into_the_gemms_epilogue(cpu_routing, leading):
    """A GEMM's output times or over a number becomes ws_mm_act(a, b, None, alpha=scale);
    on 3-D input LoRA's scaled update added to the base projection becomes ws_mm_act(h,
    w_up, base, alpha=scaling) (the scaled residual, not the plain one on the base GEMM,
    which would leave the scale's kernel); fewer C++ kernels, float64's values within fp32
    tolerance, bitwise run to run; a training step's gradients too."""
    torch.manual_seed(0)
    x = randn(*leading, 16)
    fused_code = check_fusion(Scaled(), x, *SCALED_CASES[leading])
    assert "alpha=2.0" in fused_code and "alpha=0.25" in fused_code
    model = Scaled()
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: torch.compile(model)(x).square().sum().backward())
    assert "alpha=2.0" in codes[0] and "alpha=0.25" in codes[0]
    reference = copy.deepcopy(model).double()
    reference(x.double()).square().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_matches(got.grad, want.grad, REL_TOLERANCE[torch.float32])


class ScaledLinear(torch.nn.Module):
    """A Linear with a bias whose output is divided by a number."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 24)

    def forward(self, x):
        return self.linear(x) / 4


@pytest.mark.parametrize("leading", [(32,), (2, 16)])
def test_a_scale_after_a_linear_with_a_bias_goes_into_addmm(cpu_routing, leading):
    """(x @ w.T + b) / 4 becomes addmm(b, x, w.T, beta=0.25, alpha=0.25), which routing
    lowers to ws_addmm: the scale's kernel is gone; float64's values within fp32 tolerance."""
    torch.manual_seed(0)
    fused_code = check_fusion(ScaledLinear(), randn(*leading, 16), ["ws_addmm"], ["ws_addmm"])
    assert "beta=0.25, alpha=0.25" in fused_code


def test_a_scale_that_is_no_number_stays_apart(cpu_routing):
    """A GEMM's output times a tensor, or over zero, is Inductor's kernel."""
    tritonblas_ops.fuse_epilogues(True)
    x, w = randn(32, 16), randn(16, 24)
    with torch.no_grad():
        for scale in (randn(()), randn(24), 0.0):
            out, code = compile_and_run(lambda x: (x @ w) / scale, x)
            assert routed_calls(code) == ["ws_mm"] and "alpha" not in code, scale
            if isinstance(scale, torch.Tensor):
                assert_matches(out, x.double() @ w.double() / scale.double(), REL_TOLERANCE[torch.float32])
            else:  # over zero: +-inf by the product's signs (none is zero)
                assert torch.equal(out, (x.double() @ w.double() / scale).float())


def test_an_addend_that_is_no_epilogue_bias_stays_apart(cpu_routing):
    """An addend of another dtype, or one that broadens the product, is Inductor's add."""
    tritonblas_ops.fuse_epilogues(True)
    x, w = randn(2, 8, 16), randn(16, 24)
    with torch.no_grad():
        for addend in (randn(3, 2, 8, 24), randn(2, 8, 24, dtype=torch.float64), randn(2, 1, 24)):
            out, code = compile_and_run(lambda x, r: x @ w + r, x, addend)
            assert routed_calls(code) == ["ws_mm"], addend.shape
            assert_matches(out, x.double() @ w.double() + addend.double(), REL_TOLERANCE[torch.float32])


def test_fused_glu_in_the_inline_form():
    """Under the inline path the gated GEMM is the kernel itself with GATE set and the
    gate as its bias operand (code generation only)."""
    settings.update(path="inline", cpu=True, inline_cpu=True, fuse_epilogues=True)
    with torch.no_grad():
        code = generated_code_only(GLU(), randn(32, 16))
    assert routed_calls(code) == ["ws_matmul_kernel"] * 3
    assert re.findall(r"'GATE': (\w+)", code).count("True") == 1


def test_fusion_takes_a_bias_added_after_the_gemm_but_not_a_larger_addend(cpu_routing):
    """act(x @ w + b) fuses with b as the epilogue's bias (as Inductor leaves fp32 linear
    layers on GPUs); an addend that does not broadcast to the GEMM's output stays apart."""
    tritonblas_ops.fuse_epilogues(True)
    x, w, b, big = randn(32, 16), randn(16, 24), randn(24), randn(2, 32, 24)
    with torch.no_grad():
        out, code = compile_and_run(lambda x: F.relu(x @ w + b), x)
        assert routed_calls(code) == ["ws_mm_act"] and "activation='relu'" in code
        assert_matches(out, F.relu(x.double() @ w.double() + b.double()), REL_TOLERANCE[torch.float32])
        out, code = compile_and_run(lambda x: F.silu(x @ w + big), x)
        assert routed_calls(code) == ["ws_mm"]
        assert_matches(out, F.silu(x.double() @ w.double() + big.double()), REL_TOLERANCE[torch.float32])


def test_fused_epilogues_in_the_inline_form():
    """Under the inline path a fused GEMM is the kernel itself with the activation in its
    epilogue: no op call, no pointwise kernel for the activation (code generation only)."""
    settings.update(path="inline", cpu=True, inline_cpu=True, fuse_epilogues=True)
    w, b = randn(24, 16), randn(24)
    with torch.no_grad():
        code = generated_code_only(lambda x: F.gelu(F.linear(x, w, b), approximate="tanh"), randn(32, 16))
    assert routed_calls(code) == ["ws_matmul_kernel"]
    assert [value for value in re.findall(r"'ACTIVATION': '(\w+)'", code) if value != "constexpr"] == ["gelu_tanh"]
    # The one C++ kernel left zeroes the counters: an int32 buffer is all it takes.
    assert re.findall(r"^cpp_fused_\w+ = async_compile\.cpp_pybinding\((\[.*?\])", code, re.M) == ["['int32_t*']"]


def test_scaled_residual_in_the_inline_form():
    """Under the inline path a scaled GEMM added to a tensor is the kernel itself, the scale
    its alpha and the addend its bias operand: no pointwise kernel (code generation only)."""
    settings.update(path="inline", cpu=True, inline_cpu=True, fuse_epilogues=True)
    w, residual = randn(16, 24), randn(32, 24)
    with torch.no_grad():
        code = generated_code_only(lambda x: residual + (x @ w) * 3.0, randn(32, 16))
    launch = re.search(r"ws_matmul_kernel_\d+\.run\((.*)\)", code).group(1).split(", ")
    assert routed_calls(code) == ["ws_matmul_kernel"] and "3.0" in launch
    assert re.findall(r"^cpp_fused_\w+ = async_compile\.cpp_pybinding\((\[.*?\])", code, re.M) == ["['int32_t*']"]


def _inline_fused(code: str, kernels: int, activations: set, gates: int) -> bool:
    """The inline form's code holds `kernels` routed kernels, these activations and `gates` gated ones."""
    return (len(routed_calls(code)) == kernels and activations <= set(re.findall(r"'ACTIVATION': '(\w+)'", code))
            and re.findall(r"'GATE': (\w+)", code).count("True") == gates)


# model: (its class, the op calls fused (opaque form), the inline form's activations and gates)
GPU_FUSION_CASES = {
    "mlp": (MLP, ["ws_addmm", "ws_mm_act", "ws_mm_act"], {"gelu_tanh", "silu"}, 0),
    "glu": (GLU, ["ws_mm", "ws_mm", "ws_mm_gated"], {"silu"}, 1),
    "residual": (Residual, ["ws_mm_act", "ws_mm_act", "ws_mm_act"], {"relu", "none"}, 0),
    "scaled": (Scaled, ["ws_mm", "ws_mm", "ws_mm_act", "ws_mm_act"], {"none"}, 0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_FUSION_CASES))
@pytest.mark.parametrize("path", ["opaque", "inline"])
def test_gpu_fused_epilogues(path, model):
    """On the GPU, in both paths, bf16 on 3-D input (the GEMMs' outputs are viewed): the
    MLP's activations, the Llama MLP's gated product, residual adds and scales (LoRA's) go
    into the GEMMs' epilogues (op
    calls, or kernels with ACTIVATION and GATE set), and the result is as close to a float64
    run as the unfused routed one is (plus a floor)."""
    cls, calls, fused_activations, gates = GPU_FUSION_CASES[model]
    settings.update(path=path)
    torch.manual_seed(0)
    module = cls().cuda().to(torch.bfloat16)
    x = randn(4, 16, 16, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        plain, _ = compile_and_run(module, x)
        torch._dynamo.reset()
        tritonblas_ops.fuse_epilogues(True)
        fused, code = compile_and_run(module, x)
        reference = module.double()(x.double())
    if path == "opaque":
        assert sorted(routed_calls(code)) == calls
    else:
        assert _inline_fused(code, len(calls), fused_activations, gates)
    assert rel_error(fused, reference) <= rel_error(plain, reference) + 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["opaque", "inline"])
def test_gpu_training_backward_fuses_the_activations_backward(path):
    """bf16 at real sizes: the GELU MLP's backward GEMM into the activation carries
    GELU's slope in its epilogue; the gradients are as close to float64 as unfused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), Activation("gelu_tanh"), torch.nn.Linear(4096, 1024))
    model = model.cuda().to(torch.bfloat16)
    x = randn(4, 512, 1024, dtype=torch.bfloat16, device="cuda")
    settings.update(path=path)

    def grads():
        torch._dynamo.reset()
        model.zero_grad()
        _, codes = run_and_get_code(lambda: torch.compile(model)(x).float().square().sum().backward())
        return [p.grad.clone() for p in model.parameters()], codes[-1]

    plain, _ = grads()
    tritonblas_ops.fuse_epilogues(True)
    fused, backward = grads()
    if path == "opaque":
        assert "activation='d_gelu_tanh'" in backward
    else:
        assert re.findall(r"'GATE': (\w+)", backward).count("True") == 1
    reference = copy.deepcopy(model).double()
    reference(x.double()).square().sum().backward()
    for got, unfused, want in zip(fused, plain, reference.parameters()):
        assert rel_error(got, want.grad) <= rel_error(unfused, want.grad) + 1e-2


def test_fusion_leaves_gemms_whose_output_the_backward_needs(cpu_routing):
    """In a training graph the forward's GEMM output is saved for the activation's
    gradient: no fusion there (the op writes only the activated output), and the
    gradients are the unfused ones'."""
    tritonblas_ops.fuse_epilogues(True)
    torch.manual_seed(0)
    mlp, x = MLP(), randn(32, 16, requires_grad=True)
    out, forward = compile_and_run(mlp, x)
    assert "ws_mm_act" not in forward and sorted(routed_calls(forward)) == ["ws_addmm", "ws_addmm", "ws_mm"]
    out.sum().backward()
    x_ref = x.detach().double().requires_grad_()
    mlp.double()(x_ref).sum().backward()
    assert_matches(x.grad, x_ref.grad, REL_TOLERANCE[torch.float32])


def test_fusion_follows_the_routing_rules(cpu_routing):
    """A GEMM routing would leave to Inductor (routing off, or CPU tensors when CPU routing
    is off) is not fused either."""
    tritonblas_ops.fuse_epilogues(True)
    mlp, x = MLP(), randn(32, 16)
    with torch.no_grad():
        with tritonblas_ops.routing(False):
            _, code = compile_and_run(mlp, x)
        assert routed_calls(code) == []
        tritonblas_ops.route_cpu(False)
        _, code = compile_and_run(mlp, x)
        assert routed_calls(code) == []

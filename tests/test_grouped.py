"""torch.ops.tritonblas.ws_grouped_mm (torch._grouped_mm's semantics, every group's tiles in
one work-stealing queue): against float64 per group, exactly once whatever the grid,
bitwise run to run, bad input, autograd, opcheck and routing under torch.compile. On the
CPU through Triton's interpreter; the tests marked gpu at real sizes on the GPU."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.library import opcheck

import tritonblas_ops
from tritonblas_ops import device as devices
from tritonblas_ops import grouped, settings
from tritonblas_ops.config import HALF_CONFIGS, WARP_SPECIALIZED_TILES, TileConfig
from tritonblas_ops.plan import Kernel
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches

from grouped_cases import group_sizes, offsets, operands, reference

pytestmark = pytest.mark.usefixtures("poison_empty")

SMALL = TileConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ragged", ["m", "n", "k"])
def test_uneven_and_empty_groups_match_float64(ragged, dtype):
    generator = torch.Generator().manual_seed(hash((ragged, str(dtype))) % 2**31)
    sizes = group_sizes(150, 6, generator)
    a, b, offs = operands(ragged, sizes, 37, 41, 29, dtype, generator=generator)
    out = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
    assert out.dtype == dtype
    assert_matches(out, reference(a, b, offs), REL_TOLERANCE[dtype])


@pytest.mark.parametrize("ragged", ["m", "n", "k"])
def test_groups_of_a_few_rows_and_none_at_all(ragged):
    """Groups of 0-3 rows beside a large one; and offs of zero groups (all zeros, as torch
    leaves no group to compute)."""
    a, b, offs = operands(ragged, [1, 0, 3, 40, 2, 0], 20, 24, 18, torch.float32)
    assert_matches(torch.ops.tritonblas.ws_grouped_mm(a, b, offs), reference(a, b, offs), 1e-5)
    if ragged == "m":
        none = torch.ops.tritonblas.ws_grouped_mm(a, b[:0], offs[:0])
        assert none.shape == (a.shape[0], b.shape[2]) and (none == 0).all()


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("ragged", ["m", "n", "k"])
@pytest.mark.parametrize("num_programs,num_shards", [(1, 1), (3, 2), (7, 4), (64, 3)])
def test_every_unit_once_whatever_the_grid_and_bitwise_equal(ragged, num_programs, num_shards, use_tma):
    """Every work unit of every group computed exactly once, by one program or many, with
    programs stealing across shards (which cut across groups), the counters left at zero
    (checked launches), and the same bits as any other grid; through tensor descriptors
    too (along K each unit's own, over its group's rows: x^T and dOut's layouts)."""
    generator = torch.Generator().manual_seed(num_programs)
    a, b, offs = operands(ragged, group_sizes(120, 5, generator), 32, 40, 48, torch.float32,
                          generator=generator)
    if ragged == "k":
        a = a.T.contiguous().T  # column-major, as x^T
    if ragged == "n":
        b = b.T.contiguous().T  # column-major, as torch._grouped_mm wants it
    plan = grouped.plan_grouped(a, b, torch.empty(grouped.out_shape(a, b, offs)), 5, config=SMALL,
                                use_tma=use_tma)
    units = grouped.num_units(plan, offs.tolist())
    counts = torch.zeros(plan.queue.num_tiles, dtype=torch.int32)
    out = grouped.grouped_mm(a, b, offs, unit_counts=counts, config=SMALL, use_tma=use_tma,
                             num_programs=num_programs, num_shards=num_shards)
    assert (counts[:units] == 1).all() and (counts[units:] == 0).all(), counts.tolist()
    assert_matches(out, reference(a, b, offs), 1e-5)
    alone = grouped.grouped_mm(a, b, offs, config=SMALL, num_programs=1, num_shards=1)
    assert torch.equal(out, alone)


def test_groups_along_k_take_the_warp_specialized_kernel_on_hopper(monkeypatch):
    """On sm_90 the weight gradient's grouped GEMM (groups along K, 16-bit, descriptors)
    runs the warp-specialized kernel with offs; the forward, fp32, pointer loads and the
    setting off stay on the grouped Triton kernel."""
    monkeypatch.setattr(devices, "has_tma", lambda device: True)
    monkeypatch.setattr(devices, "has_wgmma", lambda device: True)
    wide = HALF_CONFIGS[0]

    def kernel(ragged, dtype=torch.bfloat16, **knobs):
        a, b, offs = operands(ragged, [100, 0, 300], 256, 512, 64, dtype)
        a, b = (a.T.contiguous().T, b) if ragged == "k" else (a, b.mT.contiguous().mT)
        c = torch.empty(grouped.out_shape(a, b, offs), dtype=dtype)
        return grouped.plan_grouped(a, b, c, 3, config=wide, **knobs).kernel

    assert kernel("k") is Kernel.WARP_SPECIALIZED
    assert kernel("k", torch.float16) is Kernel.WARP_SPECIALIZED
    assert kernel("m") is Kernel.TRITON
    assert kernel("k", torch.float32) is Kernel.TRITON
    assert kernel("k", use_tma=False) is Kernel.TRITON
    before = settings.update(warp_specialize=False)
    try:
        assert kernel("k") is Kernel.TRITON
    finally:
        settings.restore(before)


def test_the_warp_specialized_grouped_launch_passes_the_kernels_arguments(monkeypatch):
    """The weight gradient's launch on the warp-specialized kernel: every argument of the
    kernel by name, in its order, with offs, the groups as C's batches, no bias."""
    monkeypatch.setattr(devices, "has_tma", lambda device: True)
    monkeypatch.setattr(devices, "has_wgmma", lambda device: True)
    a, b, offs = operands("k", [100, 0, 300], 256, 512, 64, torch.bfloat16)
    a = a.T.contiguous().T
    c = torch.empty(grouped.out_shape(a, b, offs), dtype=torch.bfloat16)
    plan = grouped.plan_grouped(a, b, c, 3, config=HALF_CONFIGS[0])
    assert plan.kernel is Kernel.WARP_SPECIALIZED and c.shape[0] == 3
    launched = {}

    class Recorder:
        arg_names = grouped.warp_specialized_matmul_kernel.arg_names

        def __getitem__(self, grid):
            return lambda **kwargs: launched.update(grid=grid, **kwargs)

    monkeypatch.setattr(grouped, "warp_specialized_matmul_kernel", Recorder())
    monkeypatch.setattr(grouped.launch, "gluon_descriptor", lambda tensor, layout: (tensor, layout))
    counters = torch.zeros(64, dtype=torch.int32)
    grouped._launch_kernel(plan, a, b, c, offs, counters, None)
    config = HALF_CONFIGS[0]
    variant = WARP_SPECIALIZED_TILES[(config.block_m, config.block_n, config.block_k)]
    names = [name for name in launched if name != "grid" and name not in variant.launch_options]
    assert names == Recorder.arg_names
    assert launched["grid"] == (plan.grid,) and launched["offs_ptr"] is offs
    assert launched["num_batches"] == 3 and launched["bias_desc"] is None and launched["bias_ptr"] is None
    assert launched["c_desc"][1].shape == tuple(c.shape) and launched["GROUPS_BLOCK"] == plan.groups_block


def test_repeated_calls_reuse_the_plan_until_what_it_depends_on_changes():
    a, b, offs = operands("m", [10, 0, 30], 0, 24, 32, torch.float32)
    grouped._plans.clear()
    first = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
    (plan,) = grouped._plans.values()
    assert torch.equal(torch.ops.tritonblas.ws_grouped_mm(a, b, offs + 0), first)  # other offs: the same plan
    assert list(grouped._plans.values()) == [plan]
    with tritonblas_ops.sm_budget(1):
        assert torch.equal(torch.ops.tritonblas.ws_grouped_mm(a, b, offs), first)
    assert len(grouped._plans) == 2 and {p.grid for p in grouped._plans.values()} == {plan.grid, 1}
    before = settings.update(warp_specialize=not settings.current().warp_specialize)
    try:
        torch.ops.tritonblas.ws_grouped_mm(a, b, offs)  # a plan of its own: the kernel may differ
    finally:
        settings.restore(before)
    assert len(grouped._plans) == 3


def test_batched_operands_are_a_bmm():
    a, b = torch.randn(3, 20, 24), torch.randn(3, 24, 18)
    assert_matches(torch.ops.tritonblas.ws_grouped_mm(a, b), reference(a, b, None), 1e-5)


def test_bf16_on_the_cpu_is_computed_from_fp32():
    a, b, offs = operands("m", [10, 0, 30], 0, 24, 32, torch.bfloat16)
    out = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
    assert out.dtype == torch.bfloat16
    assert_matches(out, reference(a, b, offs), REL_TOLERANCE[torch.bfloat16])


BAD_INPUTS = {
    "rank": (lambda a, b, o: (a[None, None], b, o), "must be 2-D or 3-D"),
    "dtype": (lambda a, b, o: (a, b.double(), o), "same dtype"),
    "int": (lambda a, b, o: (a.int(), b.int(), o), "not supported"),
    "inner": (lambda a, b, o: (a[:, :-1], b, o), "inner dimensions differ"),
    "no offs": (lambda a, b, o: (a, b, None), r"offs \(the groups' cumulative ends\) is needed"),
    "offs dtype": (lambda a, b, o: (a, b, o.long()), "1-D int32"),
    "experts": (lambda a, b, o: (a, b[:-1], o), "groups but offs has"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_naming_the_problem(case):
    make, message = BAD_INPUTS[case]
    a, b, offs = operands("m", [4, 4, 4], 0, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tritonblas.ws_grouped_mm(*make(a, b, offs))


def test_bias_out_dtype_and_offs_of_a_bmm_raise():
    a, b, offs = operands("m", [4, 4, 4], 0, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="bias is not supported"):
        torch.ops.tritonblas.ws_grouped_mm(a, b, offs, torch.zeros(16))
    with pytest.raises(RuntimeError, match="out_dtype must be None or"):
        torch.ops.tritonblas.ws_grouped_mm(a, b, offs, out_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="offs must be None for 3-D x 3-D"):
        torch.ops.tritonblas.ws_grouped_mm(b, b, offs)


@pytest.mark.parametrize("ends,message", [([4, 2, 8], r"offs\[1\] = 2 is below offs\[0\] = 4"),
                                          ([4, 8, 99], r"offs\[2\] = 99 is outside"),
                                          ([-1, 8, 9], r"offs\[0\] = -1 is outside")])
def test_malformed_offs_raise_in_checked_launches(checked, ends, message):
    a, b, _ = operands("m", [4, 4, 4], 0, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tritonblas.ws_grouped_mm(a, b, torch.tensor(ends, dtype=torch.int32))


def test_malformed_offs_unchecked_are_clamped_and_flagged(unchecked):
    """Unchecked launches never read offs on the host: the kernel clamps the groups into
    disjoint ones inside the operands (nothing read or written out of bounds) and flags the
    launch's status, which the next checked launch on that buffer reports."""
    a, b, _ = operands("m", [4, 4, 4], 0, 16, 16, torch.float32)
    out = torch.ops.tritonblas.ws_grouped_mm(a, b, torch.tensor([6, 2, 99], dtype=torch.int32))
    clamped = torch.tensor([6, 6, a.shape[0]], dtype=torch.int32)
    assert_matches(out, reference(a, b, clamped), 1e-5)
    tritonblas_ops.set_checked(True)
    with pytest.raises(RuntimeError, match="got offs that were not non-decreasing"):
        torch.ops.tritonblas.ws_grouped_mm(a, b, clamped)
    torch.ops.tritonblas.ws_grouped_mm(a, b, clamped)  # the buffer was reset


@pytest.mark.parametrize("ragged", ["m", "n", "k", None])
def test_gradients_are_grouped_gemms_through_the_op(ragged):
    """Both gradients, against autograd through the float64 reference."""
    if ragged is None:
        a, b, offs = torch.randn(2, 12, 10), torch.randn(2, 10, 14), None
    else:
        a, b, offs = operands(ragged, [7, 0, 12, 5], 11, 13, 9, torch.float32)
    a.requires_grad_(), b.requires_grad_()
    grad = torch.randn(grouped.out_shape(a, b, offs))
    torch.ops.tritonblas.ws_grouped_mm(a, b, offs).backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    reference(a64, b64, offs).backward(grad.double())
    assert_matches(a.grad, a64.grad, 1e-5)
    assert_matches(b.grad, b64.grad, 1e-5)


@pytest.mark.parametrize("ragged", ["m", "k", None])
def test_forward_mode_tangents_are_grouped_gemms_through_the_op(ragged):
    """torch.func.jvp and forward_ad's dual tensors, tangents on both operands and on one:
    the float64 reference's tangents."""
    import torch.autograd.forward_ad as fwad

    if ragged is None:
        a, b, offs = torch.randn(2, 12, 10), torch.randn(2, 10, 14), None
    else:
        a, b, offs = operands(ragged, [7, 0, 12, 5], 11, 13, 9, torch.float32)
    for tangents in ((torch.randn_like(a), torch.randn_like(b)), (torch.zeros_like(a), torch.randn_like(b))):
        out, got = torch.func.jvp(lambda x, y: torch.ops.tritonblas.ws_grouped_mm(x, y, offs), (a, b), tangents)
        want_out, want = torch.func.jvp(lambda x, y: reference(x, y, offs), (a.double(), b.double()),
                                        tuple(t.double() for t in tangents))
        assert_matches(out, want_out, 1e-5)
        assert_matches(got, want, 1e-5)
    with fwad.dual_level():
        tangent = torch.randn_like(a)
        got = fwad.unpack_dual(torch.ops.tritonblas.ws_grouped_mm(fwad.make_dual(a, tangent), b, offs)).tangent
    assert got is not None, "forward_ad got no tangent"
    assert_matches(got, reference(tangent.double(), b.double(), offs), 1e-5)


@pytest.mark.parametrize("ragged", ["m", "n", "k"])
def test_opcheck(ragged):
    a, b, offs = operands(ragged, [5, 0, 9], 8, 8, 8, torch.float32)
    opcheck(torch.ops.tritonblas.ws_grouped_mm.default, (a.requires_grad_(), b.requires_grad_(), offs))


def test_fake_kernel_gives_the_shape_from_the_operands():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.tritonblas.ws_grouped_mm(torch.empty(100, 16), torch.empty(16, 24),
                                                 torch.empty(5, dtype=torch.int32))
    assert out.shape == (5, 100, 24)


def moe_forward(x, w_up, w_down, offs):
    """An expert MLP over tokens sorted by expert, weights stored (G, out, in) as torch's
    grouped GEMMs want them (column-major B)."""
    return torch._grouped_mm(torch.relu(torch._grouped_mm(x, w_up.mT, offs)), w_down.mT, offs)


def check_compiled_moe_routes_and_trains(x, w_up, w_down, offs, tolerance: float) -> None:
    """moe_forward compiled with routing on, and its backward: both grouped GEMMs of the
    forward and all four of the backward (ragged M and ragged K) call ws_grouped_mm, and the
    output and gradients match eager torch._grouped_mm's on every row a group holds (torch
    leaves the others unwritten; the op writes zeros there, and their gradients are zero)."""
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            out, forward = run_and_get_code(torch.compile(moe_forward), x, w_up, w_down, offs)
            _, backward = run_and_get_code(lambda: out.float().square().sum().backward())
    finally:
        torch._dynamo.reset()
    assert "\n".join(forward).count("tritonblas.ws_grouped_mm.default(") == 2
    assert "\n".join(backward).count("tritonblas.ws_grouped_mm.default(") == 4
    expected = [t.detach().clone().requires_grad_() for t in (x, w_up, w_down)]
    ref = moe_forward(*expected, offs)
    ref.float().square().sum().backward()
    rows = offs[-1].item()
    assert (out[rows:] == 0).all() and (x.grad[rows:] == 0).all()
    assert_matches(out[:rows].float(), ref[:rows].float(), tolerance)
    assert_matches(x.grad[:rows].float(), expected[0].grad[:rows].float(), tolerance)
    for got, want in zip((w_up, w_down), expected[1:]):
        assert_matches(got.grad.float(), want.grad.float(), tolerance)


def test_compiled_grouped_gemms_route_forward_and_backward():
    """On CPU (route_cpu; bf16, the meta kernel's only dtype, computed from fp32 by the
    interpreter), with 7 rows past offs[-1]."""
    tritonblas_ops.route_cpu(True)
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(48, 32, generator=generator).bfloat16().requires_grad_()
        w_up = torch.randn(4, 16, 32, generator=generator).bfloat16().requires_grad_()
        w_down = torch.randn(4, 32, 16, generator=generator).bfloat16().requires_grad_()
        check_compiled_moe_routes_and_trains(x, w_up, w_down, offsets([9, 0, 20, 12]), 2e-2)
    finally:
        tritonblas_ops.route_cpu(False)


def test_routing_off_leaves_grouped_gemms_to_inductor():
    tritonblas_ops.route_cpu(True)
    try:
        x, w_up, w_down = torch.randn(24, 32).bfloat16(), torch.randn(3, 16, 32).bfloat16(), torch.randn(3, 32, 16).bfloat16()
        torch._dynamo.reset()
        with tritonblas_ops.routing(False), torch._inductor.config.patch(force_disable_caches=True):
            _, code = run_and_get_code(torch.compile(moe_forward), x, w_up, w_down, offsets([5, 9, 6]))
    finally:
        tritonblas_ops.route_cpu(False)
        torch._dynamo.reset()
    assert "ws_grouped_mm" not in "\n".join(code) and "_grouped_mm" in "\n".join(code)


# ---------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("ragged,groups,m,n,k", [
    ("m", 8, 0, 4096, 2048), ("m", 64, 0, 1408, 2048), ("m", 128, 0, 2048, 1024),
    ("n", 8, 512, 0, 1024), ("k", 8, 1024, 1408, 0), ("k", 64, 512, 768, 0)])
def test_gpu_bf16_grouped_matches_float64(ragged, groups, m, n, k, use_tma):
    generator = torch.Generator().manual_seed(groups)
    sizes = group_sizes(16384 if ragged == "m" else 8192, groups, generator)
    a, b, offs = operands(ragged, sizes, m, n, k, torch.bfloat16, "cuda", generator)
    if ragged == "m":
        b = b.mT.contiguous().mT  # column-major experts, as torch._grouped_mm wants them
    if ragged == "k":
        a = a.T.contiguous().T  # x^T, as the weight gradient has it
    if ragged == "n":
        b = b.T.contiguous().T
    out = grouped.grouped_mm(a, b, offs, use_tma=use_tma)
    assert_matches(out, reference(a, b, offs), REL_TOLERANCE[torch.bfloat16])
    assert torch.equal(out, grouped.grouped_mm(a, b, offs, use_tma=use_tma, num_programs=17))


@pytest.mark.gpu
def test_gpu_grouped_against_torch_and_in_a_cuda_graph():
    generator = torch.Generator().manual_seed(1)
    a, b, offs = operands("m", group_sizes(8192, 16, generator), 0, 1024, 512, torch.bfloat16, "cuda", generator)
    b = b.mT.contiguous().mT
    torch_out = torch._grouped_mm(a, b, offs)
    rows = offs[-1].item()
    out = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
    assert_matches(out[:rows], torch_out[:rows].float(), 1e-2)
    tritonblas_ops.set_checked(False)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.tritonblas.ws_grouped_mm(a, b, offs)
        new_offs = offsets(group_sizes(8192, 16, generator)).cuda()
        offs.copy_(new_offs)  # the graph reads offs when replayed: new groups, no recapture
        graph.replay()
    finally:
        tritonblas_ops.set_checked(True)
    assert torch.equal(captured, torch.ops.tritonblas.ws_grouped_mm(a, b, offs))
    assert_matches(captured, reference(a, b, offs), REL_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_compiled_moe_trains_through_the_op():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 1024, generator=generator).cuda().bfloat16().requires_grad_()
    w_up = (torch.randn(8, 2048, 1024, generator=generator) / 32).cuda().bfloat16().requires_grad_()
    w_down = (torch.randn(8, 1024, 2048, generator=generator) / 45).cuda().bfloat16().requires_grad_()
    offs = offsets(group_sizes(4096, 8, generator)).cuda()
    with tritonblas_ops.routing(True, policy="all"):
        check_compiled_moe_routes_and_trains(x, w_up, w_down, offs, 2e-2)

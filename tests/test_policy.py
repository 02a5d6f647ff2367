"""Routing policy "auto" (policy.py): its predictions from the H200 measurements, and its
decisions reaching compiled code (on the CPU, with a stand-in GPU's measurements)."""

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import tritonblas_ops
from tritonblas_ops import measured, policy, settings
from tritonblas_ops.policy import predict

H200 = measured.GPUS[0]
BF16 = torch.bfloat16
CUDA = torch.device("cuda", 0)


def measured_ratio(dtype: str, m: int, n: int, k: int) -> float:
    """The kernel's measured time over torch.mm's for one corpus shape."""
    (cublas_us, kernel_us), = [(c, w) for mm, nn, kk, c, w in H200["shapes"][dtype] if (mm, nn, kk) == (m, n, k)]
    return kernel_us / cublas_us


def test_the_measurements_cover_every_dtype_the_kernel_takes():
    assert H200["device"] == "NVIDIA H200" and H200["num_sms"] == 132
    assert set(H200["shapes"]) == {"bfloat16", "float16", "float32"}
    assert all(len(shapes) >= 10 for shapes in H200["shapes"].values())
    assert 1000 < H200["bandwidth_gbps"] < 5000 and 5 < H200["host_us"] < 100


def test_the_h100_has_measurements_of_its_own():
    """The H100 SXM's entry: its own corpus runs (bf16 full, fp16 and fp32 quick) and cuBLAS's
    times there, not the H200's."""
    h100 = policy._measurements("NVIDIA H100 80GB HBM3", 132)
    assert h100 is not None and h100 is not H200
    assert set(h100["shapes"]) == {"bfloat16", "float16", "float32"}
    assert len(h100["shapes"]["bfloat16"]) >= 50 and len(h100["shapes"]["float16"]) >= 10
    assert 1000 < h100["bandwidth_gbps"] < H200["bandwidth_gbps"]
    for dtype in h100["shapes"]:
        assert h100["shapes"][dtype] != H200["shapes"][dtype]
    assert predict(h100, torch.float16, 4096, 4096, 4096, saved_passes=0) is not None
    assert predict(h100, BF16, 4096, 4096, 4096, saved_passes=0) is not None


def test_a_lone_measured_shape_predicts_its_own_times():
    """4095x4097x4093 (unaligned rows) has no other unaligned shape within a factor of 2."""
    (cublas_us, kernel_us), = [(c, w) for m, n, k, c, w in H200["shapes"]["bfloat16"]
                               if (m, n, k) == (4095, 4097, 4093)]
    predicted = predict(H200, BF16, 4095, 4097, 4093, saved_passes=0)
    assert predicted.cublas_us == pytest.approx(cublas_us) and predicted.kernel_us == pytest.approx(kernel_us)
    assert predicted.routes and predicted.saved_us == 0


def test_a_prediction_takes_the_worst_neighbour_and_scales_by_the_work():
    """8192x14336x4096 (a Llama-3-8B up projection) has measured neighbours on both sides of
    1.0x: the prediction is the slowest one's ratio, at cuBLAS's time of the shape itself."""
    predicted = predict(H200, BF16, 8192, 14336, 4096, saved_passes=0)
    neighbours = [(m, n, k) for m, n, k, _, _ in H200["shapes"]["bfloat16"]
                  if policy.alignment_class(n, k, 2) == "aligned"
                  and all(0.5 <= x / y <= 2 for x, y in ((m, 8192), (n, 14336), (k, 4096)))]
    assert len(neighbours) > 3
    worst = max(measured_ratio("bfloat16", *shape) for shape in neighbours)
    assert predicted.kernel_us / predicted.cublas_us == pytest.approx(worst)
    assert not predicted.routes
    # Half the rows: cuBLAS's time of the nearest neighbour scaled by the work.
    assert predict(H200, BF16, 4096, 14336, 4096, saved_passes=0).cublas_us == pytest.approx(
        [c for m, n, k, c, _ in H200["shapes"]["bfloat16"] if (m, n, k) == (4096, 14336, 4096)][0])


def test_a_fused_epilogue_counts_the_pointwise_kernel_it_removes():
    """The same GEMM with its activation or gated product fused: 2 * M * N elements less
    traffic at the measured bandwidth outweigh the kernel's few percent."""
    fused = predict(H200, BF16, 8192, 14336, 4096, saved_passes=2)
    assert fused.saved_us == pytest.approx(2 * 8192 * 14336 * 2 / (H200["bandwidth_gbps"] * 1e3))
    assert fused.routes and fused.kernel_us > fused.cublas_us


def test_an_epilogue_that_reads_an_output_sized_operand_pays_for_the_read():
    """A gate, a pre-activation or a residual read by the epilogue costs the kernel more than
    the pointwise kernel paid for it (EPILOGUE_OPERAND_GBPS, measured): a Llama-3-8B GLU's up
    projection and GPT-2's activation backward no longer pay, an activation without an
    operand still does."""
    plain = predict(H200, BF16, 8192, 14336, 4096, saved_passes=2)
    gated = predict(H200, BF16, 8192, 14336, 4096, saved_passes=2, read_passes=1)
    assert gated.read_us == pytest.approx(8192 * 14336 * 2 * (1 / policy.EPILOGUE_OPERAND_GBPS
                                                             - 1 / H200["bandwidth_gbps"]) / 1e3)
    assert plain.routes and not gated.routes and plain.read_us == 0
    assert predict(H200, BF16, 8192, 3072, 768, saved_passes=2).routes
    assert not predict(H200, BF16, 8192, 3072, 768, saved_passes=2, read_passes=1).routes


def test_decode_rows_share_one_neighbourhood():
    """Up to 16 rows a GEMM reads the same weight in the same time: M = 1..16 predict alike."""
    predictions = {predict(H200, BF16, m, 14336, 4096, saved_passes=0) for m in (1, 3, 7, 16)}
    assert len(predictions) == 1
    assert predict(H200, BF16, 64, 14336, 4096, saved_passes=0) not in predictions


def test_no_measured_neighbour_no_prediction():
    # K = 256: the smallest K measured is 768 (the corpus's `models` group measures GPT-2's MLP).
    assert predict(H200, BF16, 8192, 3072, 256, saved_passes=2) is None
    assert predict(H200, BF16, 256, 256, 264, saved_passes=0) is None  # no mid-line shape this small
    assert predict(H200, torch.float16, 8192, 8192, 8192, saved_passes=0) is not None


@pytest.mark.parametrize("n,k,expected", [(4096, 4096, "aligned"), (1000, 4096, "mid-line"),
                                          (4096, 1000, "mid-line"), (4097, 4096, "unaligned"),
                                          (4096, 777, "unaligned")])
def test_alignment_classes(n, k, expected):
    assert policy.alignment_class(n, k, 2) == expected


def test_decisions_on_the_h200(monkeypatch):
    monkeypatch.setattr(policy, "measurements", lambda device: H200)
    assert policy.faster(CUDA, BF16, 1, 4095, 4097, 4093)
    assert policy.faster(CUDA, BF16, 1, 8192, 14336, 4096, saved_passes=2)
    assert not policy.faster(CUDA, BF16, 1, 8192, 14336, 4096)
    assert not policy.faster(CUDA, BF16, 2, 4095, 4097, 4093)  # batched: not measured
    assert not policy.faster(CUDA, BF16, 1, 4095, 4097, 4093, grouped=True)
    # 16x4096x4096: measured faster than cuBLAS, but in less time than the op's host time.
    assert measured_ratio("bfloat16", 16, 4096, 4096) < 1
    assert predict(H200, BF16, 16, 4096, 4096, saved_passes=0).routes
    assert not policy.faster(CUDA, BF16, 1, 16, 4096, 4096)
    assert policy.faster(CUDA, BF16, 1, 16, 4096, 4096, graphed=True)  # CUDA graphs: no host time
    # GPT-2's up projection with its GELU: faster fused, but its ~60 us are under 4 host
    # times (~100 us): without CUDA graphs its step is bound by the host, which the op adds to.
    gelu_fused = predict(H200, BF16, 8192, 3072, 768, saved_passes=2)
    assert gelu_fused.routes and H200["host_us"] < gelu_fused.kernel_us < policy.HOST_BOUND_MULTIPLE * H200["host_us"]
    assert not policy.faster(CUDA, BF16, 1, 8192, 3072, 768, saved_passes=2)
    assert policy.faster(CUDA, BF16, 1, 8192, 3072, 768, saved_passes=2, graphed=True)
    # FP32 was measured as TF32 only.
    fp32_shape = next((m, n, k) for m, n, k, c, w in H200["shapes"]["float32"]
                      if predict(H200, torch.float32, m, n, k, saved_passes=0).routes
                      and predict(H200, torch.float32, m, n, k, saved_passes=0).kernel_us
                      > policy.HOST_BOUND_MULTIPLE * H200["host_us"])
    assert policy.faster(CUDA, torch.float32, 1, *fp32_shape, tf32=True)
    assert not policy.faster(CUDA, torch.float32, 1, *fp32_shape, tf32=False)


def test_decisions_are_logged_with_their_reasons(monkeypatch, caplog):
    monkeypatch.setattr(policy, "measurements", lambda device: H200)
    with caplog.at_level("DEBUG", logger="tritonblas_ops.policy"):
        policy.faster(CUDA, BF16, 1, 8192, 14336, 4096, saved_passes=2)
        policy.faster(CUDA, BF16, 1, 8192, 3072, 256)
        policy.faster(CUDA, BF16, 1, 16, 4096, 4096)
    routed, unmeasured, host_bound = caplog.messages
    assert routed.startswith("policy auto routes 1x8192x14336x4096 torch.bfloat16 fused: kernel ")
    assert unmeasured.endswith("leaves to Inductor 1x8192x3072x256 torch.bfloat16: no measured shape within 2x")
    assert "under 4x the op's host time" in host_bound


def test_an_unmeasured_gpu_routes_nothing_and_says_so_once():
    with pytest.warns(UserWarning, match="no measurements for Some GPU X1 \\(7 SMs\\).*set_policy\\('all'\\)"):
        assert policy._measurements("Some GPU X1", 7) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy._measurements("Some GPU X1", 7) is None
    # The H200's name with another SM count is another GPU.
    with pytest.warns(UserWarning):
        assert policy._measurements("NVIDIA H200", 114) is None
    assert policy._measurements("NVIDIA H200", 132) is H200


def test_cpu_gemms_are_routed_whatever_auto_would_predict():
    assert policy.measurements(torch.device("cpu")) is None
    assert policy.faster(torch.device("cpu"), torch.float32, 3, 8, 8, 8)


# ---------------------------------------------------------------------------------------
# Decisions in compiled code: CPU GEMMs with a stand-in GPU's measurements
# ---------------------------------------------------------------------------------------

# fp16 64x64x64: the kernel measured 2x faster; 64x256x256: 1.25x slower, which a fused
# epilogue's saved traffic outweighs at this bandwidth (2*64*256*2 bytes at 1 GB/s = 66 us
# > 2.5 us lost). Neither is within a factor of 2 of the other.
STAND_IN = {"device": "stand-in", "num_sms": 1, "bandwidth_gbps": 1.0, "host_us": 0.0,
            "shapes": {"float16": ((64, 64, 64, 10.0, 5.0), (64, 256, 256, 10.0, 12.5))}}


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """CPU GEMMs routed under policy "auto" with STAND_IN's measurements, the compiled-code
    caches off (a hit would skip the lowering's decisions)."""
    before = settings.current()
    monkeypatch.setattr(policy, "measurements", lambda device: STAND_IN)
    tritonblas_ops.route_cpu(True)
    tritonblas_ops.set_policy("auto")
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        settings.restore(before)
        torch._dynamo.reset()


def compiled_ops(fn, *args) -> list[str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    expected = fn(*args)
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
    return re.findall(r"torch\.ops\.tritonblas\.(\w+)\.default\(", "\n".join(code))


def half(*shape):
    return torch.randn(*shape, dtype=torch.float16)


def test_auto_routes_only_what_the_measurements_predict_faster(stand_in_gpu):
    assert compiled_ops(torch.mm, half(64, 64), half(64, 64)) == ["ws_mm"]
    assert compiled_ops(torch.mm, half(64, 256), half(256, 256)) == []
    assert compiled_ops(torch.mm, half(8, 4), half(4, 8)) == []  # no neighbour
    assert compiled_ops(torch.bmm, half(2, 64, 64), half(2, 64, 64)) == []  # batched: none measured


def test_auto_routes_host_bound_gemms_only_under_cuda_graphs(stand_in_gpu, monkeypatch):
    """A GEMM predicted faster than cuBLAS but shorter than the op's host time is left to
    Inductor, unless the graph is compiled for CUDA graphs, whose replays pay no host time."""
    monkeypatch.setattr(policy, "measurements", lambda device: {**STAND_IN, "host_us": 100.0})
    x, w = half(64, 64), half(64, 64)
    assert compiled_ops(torch.mm, x, w) == []
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert compiled_ops(torch.mm, x, w) == ["ws_mm"]


def test_auto_routes_a_slower_gemm_whose_fused_epilogue_saves_more(stand_in_gpu):
    def mlp_up(x, w):
        return F.gelu(x @ w, approximate="tanh")

    def glu_up(x, w_gate, w_up):
        return F.silu(x @ w_gate) * (x @ w_up)

    def residual(x3, w):
        return x3 + x3 @ w

    x, w = half(64, 256), half(256, 256)
    assert compiled_ops(mlp_up, x, w) == []  # fusion off: the bare GEMM is predicted slower
    assert compiled_ops(residual, x.view(1, 64, 256), w) == []
    with tritonblas_ops.routing(fuse_epilogues=True):
        assert compiled_ops(mlp_up, x, w) == ["ws_mm_act"]
        assert compiled_ops(glu_up, x, w, half(256, 256)) == ["ws_mm_gated"]  # the gate GEMM: Inductor's
        assert compiled_ops(residual, x.view(1, 64, 256), w) == ["ws_mm_act"]  # one pass saved: 33 us


def test_fusion_tells_the_policy_what_each_epilogue_saves_and_reads(stand_in_gpu, monkeypatch):
    """Two output-sized passes saved for an activation, a gated product or an activation's
    backward (its kernel read the GEMM's output and wrote its own); one for a residual. And
    the output-sized operands the epilogue reads: the gate, a whole residual (a broadcast
    one, a few KB, does not count)."""
    asked = []
    faster = policy.faster

    def recording(*args, **kwargs):
        asked.append((kwargs.get("saved_passes", 0), kwargs.get("read_passes", 0)))
        return faster(*args, **kwargs)

    monkeypatch.setattr(policy, "faster", recording)
    x, w, row = half(1, 64, 256), half(256, 256), half(256)
    cases = [(lambda x, w: F.silu(x @ w), (2, 0)),
             (lambda x, w: x + x @ w, (1, 1)),
             (lambda x, w: x @ w + row, (1, 0)),
             (lambda x, w: F.silu(x @ w) * (x @ w.t()), (2, 1))]
    with tritonblas_ops.routing(fuse_epilogues=True):
        for fn, expected in cases:
            asked.clear()
            compiled_ops(fn, x, w)
            assert expected in asked, (expected, asked)

"""The kernels compile for Hopper (sm_90) without a GPU: Triton's front end and the ptxas
its wheel bundles, on the CPU. The interpreter runs Python, so it misses what only the
compiler checks (a loop-carried variable changing type, a constexpr where a tensor must
be); this catches it in CI, before device time is spent on it."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tritonblas_ops.activations import SLOPES
from tritonblas_ops import config as configs
from tritonblas_ops.config import (FP32_INVARIANT_CONFIGS, FP32_SWAPPED_CONFIGS, HALF_INVARIANT_CONFIGS,
                                   HALF_INVARIANT_DECODE_CONFIGS, HALF_SWAPPED_CONFIGS, WARP_SPECIALIZED_TILES)
from tritonblas_ops.grouped_kernel import ws_grouped_kernel
from tritonblas_ops.kernel import ws_matmul_kernel
from tritonblas_ops.warp_specialized_kernel import warp_specialized_matmul_kernel

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_BYTES = 232448  # a CTA's shared memory on H100 and H200 (227 KiB)
POINTERS = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", "offs_ptr": "*i32",
            "counters_ptr": "*i32", "partials_ptr": "*fp32", "budget_ptr": "*i32", "unit_counts_ptr": "*i32"}
FLOATS = {"alpha": "fp32", "beta": "fp32"}


def compile_for_hopper(kernel, constants: dict, descriptors: dict, *, num_warps: int = 8, num_stages: int = 3,
                       pointers: dict = POINTERS):
    """Compile `kernel` with ints for every runtime argument not named here, the pointers
    above (a None in `constants` makes one a constexpr None), tensor descriptors of the
    given types, and `constants`."""
    signature = {name: pointers.get(name, FLOATS.get(name, "i32")) for name in kernel.arg_names}
    signature.update(descriptors)
    for name in constants:
        signature[name] = "constexpr"
    values = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(kernel, signature, values), target=HOPPER,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def descriptor(rows: int, cols: int, dtype: str = "bf16") -> str:
    return f"tensordesc<{dtype}[1, {rows}, {cols}]>"


TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_SHARDS=1, COUNTER_STRIDE=32, CHECKED=True,
            INPUT_PRECISION="ieee")


@pytest.mark.parametrize("int64_index,live_budget", [(False, True), (True, False)])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("ragged", ["m", "n", "k"])
def test_grouped_kernel_compiles(ragged, use_tma, int64_index, live_budget):
    host_descriptors = use_tma and ragged != "k"  # along K the programs make their own
    constants = dict(TILE, INT64_INDEX=int64_index, USE_TMA=use_tma, A_ROW_MAJOR=ragged != "k",
                     B_ROW_MAJOR=ragged != "n", RAGGED=ragged, GROUPS_BLOCK=128, unit_counts_ptr=None)
    if not live_budget:
        constants["budget_ptr"] = None
    descriptors = {}
    if host_descriptors:
        descriptors = {"a_desc": descriptor(128, 64),
                       "b_desc": descriptor(64, 256) if ragged == "m" else descriptor(256, 64)}
    else:
        constants.update(a_desc=None, b_desc=None)
    assert compile_for_hopper(ws_grouped_kernel, constants, descriptors).asm["ptx"]


@pytest.mark.parametrize("use_tma,split_k,work_stealing,k_chunks", [
    (True, 1, True, 1), (False, 1, True, 1), (True, 4, True, 1), (False, 2, False, 1), ("operands", 1, True, 1),
    (True, 2, True, 2), (False, 2, True, 2)])
def test_gemm_kernel_compiles(use_tma, split_k, work_stealing, k_chunks):
    """use_tma "operands": A's and B's descriptors from the host, C's made by the programs (the
    inline form under CUDA graphs). K chunks as split-K units (batch-invariant): a split
    tail's whole tiles sum them in turn, a run-time count of chunks."""
    constants = dict(TILE, SPLIT_K=split_k, K_CHUNKS=k_chunks, SUM_ROWS=32, WORK_STEALING=work_stealing,
                     INT64_INDEX=False, USE_TMA=use_tma, A_ROW_MAJOR=True, B_ROW_MAJOR=True, TMA_STORE=use_tma,
                     ACTIVATION="silu", GATE=split_k == 1, unit_counts_ptr=None)
    if split_k == 1:
        constants["partials_ptr"] = None
    descriptors = {}
    if use_tma:
        descriptors = {"a_desc": descriptor(128, 64), "b_desc": descriptor(64, 256), "c_desc": descriptor(128, 256)}
        if use_tma == "operands":
            del descriptors["c_desc"]
            constants.update(USE_TMA=True, TMA_STORE=True, c_desc=None)
    else:
        constants.update(a_desc=None, b_desc=None, c_desc=None)
    assert compile_for_hopper(ws_matmul_kernel, constants, descriptors).asm["ptx"]


# Every tile the selectors can pick: normal mode's (in the invariant lists), the invariant
# ones and the transposed decode tiles of both modes.
HALF_DECODE = tuple(config for config, _ in HALF_INVARIANT_DECODE_CONFIGS)
EVERY_TILE = ([(config, "bf16") for config in dict.fromkeys(HALF_INVARIANT_CONFIGS + HALF_SWAPPED_CONFIGS + HALF_DECODE)]
              + [(config, "fp32") for config in dict.fromkeys(FP32_INVARIANT_CONFIGS + FP32_SWAPPED_CONFIGS)])


@pytest.mark.parametrize("config,dtype", EVERY_TILE)
def test_every_tile_fits_shared_memory(config, dtype):
    """Every tile's pipeline (the invariant ones' long K steps and up to 8 stages included)
    fits a Hopper SM's shared memory with C stored through TMA, K chunks summed in each tile
    where two accumulators fit (the launch's largest form): Triton 3.9 stages C apart from
    the pipeline, which TF32's 128x256 tile did not survive (NOTES.md step 49)."""
    chunks = 2 if configs.fits_chunked(config) else 1
    constants = dict(TILE, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     SPLIT_K=1, K_CHUNKS=chunks, SUM_ROWS=32, WORK_STEALING=True, INT64_INDEX=False,
                     USE_TMA=True, A_ROW_MAJOR=True, B_ROW_MAJOR=True, TMA_STORE=True, ACTIVATION="none",
                     GATE=False, partials_ptr=None, unit_counts_ptr=None,
                     INPUT_PRECISION="tf32" if dtype == "fp32" else "ieee")
    descriptors = {"a_desc": descriptor(config.block_m, config.block_k, dtype),
                   "b_desc": descriptor(config.block_k, config.block_n, dtype),
                   "c_desc": descriptor(config.block_m, config.block_n, dtype)}
    pointers = {name: ptr.replace("bf16", dtype) for name, ptr in POINTERS.items()}
    compiled = compile_for_hopper(ws_matmul_kernel, constants, descriptors, num_warps=config.num_warps,
                                  num_stages=config.num_stages, pointers=pointers)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, (config, compiled.metadata.shared)


@pytest.mark.parametrize("activation", SLOPES)
def test_every_slope_gate_compiles(activation):
    """The backward's fused epilogues: a GEMM's product times an activation's slope."""
    constants = dict(TILE, SPLIT_K=1, K_CHUNKS=1, SUM_ROWS=32, WORK_STEALING=True, INT64_INDEX=False,
                     USE_TMA=False, A_ROW_MAJOR=True, B_ROW_MAJOR=True, TMA_STORE=False, ACTIVATION=activation,
                     GATE=True, unit_counts_ptr=None, partials_ptr=None, a_desc=None, b_desc=None, c_desc=None)
    assert compile_for_hopper(ws_matmul_kernel, constants, {}).asm["ptx"]


def nvmma_descriptor(dtype: str, box: tuple) -> str:
    """A Gluon host descriptor's type: its box and the NVMMA shared layout launch.py gives it."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(list(box), {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    return f"tensordesc<{dtype}[{', '.join(map(str, box))}],{layout!r}>"


def compile_warp_specialized(constants: dict, types: dict, variant):
    """warp_specialized_matmul_kernel compiled for sm_90 with `constants`, the argument types
    in `types` (descriptors), the rest typed as compile_for_hopper types them, and the
    variant's launch options; checked warp-specialized (setmaxnreg in the PTX: the
    partitions' register budgets) and within a CTA's shared memory."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = warp_specialized_matmul_kernel
    signature = {name: POINTERS.get(name, FLOATS.get(name, "i32")) for name in kernel.arg_names}
    signature.update(types)
    for name in constants:
        signature[name] = "constexpr"
    values = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(GluonASTSource(kernel, signature, values), target=HOPPER,
                              options=variant.launch_options)
    assert "setmaxnreg" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    return compiled


@pytest.mark.parametrize("a_row_major,b_row_major,bias,live_budget,activation,gate,prefetch",
                         [(True, True, False, False, "none", False, False),
                          (True, False, True, True, "gelu", False, False),
                          (False, True, True, False, "silu", True, False),
                          (False, False, True, True, "d_gelu_tanh", True, False),
                          (True, False, True, False, "none", False, True),
                          (True, True, True, True, "d_gelu", True, True)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tile", list(WARP_SPECIALIZED_TILES))
def test_warp_specialized_kernel_compiles(tile, dtype, a_row_major, b_row_major, bias, live_budget, activation,
                                          gate, prefetch):
    """Each warp-specialized variant compiles; `prefetch`: the bias read ahead into C's
    buffers (the variant's fewer stages)."""
    bm, bn, bk = tile
    variant = WARP_SPECIALIZED_TILES[tile]
    if prefetch:
        variant = variant.prefetching(bn)
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SHARDS=2, COUNTER_STRIDE=64, CHECKED=True,
                     A_ROW_MAJOR=a_row_major, B_ROW_MAJOR=b_row_major, ACTIVATION=activation, GATE=gate,
                     **variant.kernel_constants())
    types = dict(bias_ptr=f"*{dtype}",
                 a_desc=nvmma_descriptor(dtype, (1, bm, bk) if a_row_major else (1, bk, bm)),
                 b_desc=nvmma_descriptor(dtype, (1, bk, bn) if b_row_major else (1, bn, bk)),
                 c_desc=nvmma_descriptor(dtype, (1, bm, variant.epilogue_n)),
                 bias_desc=nvmma_descriptor(dtype, (1, bm, variant.epilogue_n)))
    if not bias:
        constants["bias_ptr"] = None
    if not prefetch:
        constants["bias_desc"] = None
    if not live_budget:  # the launches without a budget compile without the tests' unit counts too
        constants["budget_ptr"] = None
        constants["unit_counts_ptr"] = None
    constants.update(offs_ptr=None, GROUPS_BLOCK=1, K_CHUNKS=1)  # a GEMM (grouped launches: below)
    compile_warp_specialized(constants, types, variant)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tile", list(WARP_SPECIALIZED_TILES))
def test_warp_specialized_kernel_compiles_for_groups_along_k(tile, dtype):
    """The grouped weight gradient's launch (offs: groups along K; A = x^T column-major, B =
    dOut row-major, C one batch per group): the loader's group ranges and K offsets, the MMA
    warps' zeroing of a group's last partial K step."""
    variant = WARP_SPECIALIZED_TILES[tile]
    bm, bn, bk = tile
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SHARDS=1, COUNTER_STRIDE=64, CHECKED=True,
                     A_ROW_MAJOR=False, B_ROW_MAJOR=True, ACTIVATION="none", GATE=False, GROUPS_BLOCK=128,
                     bias_ptr=None, bias_desc=None, budget_ptr=None, unit_counts_ptr=None, K_CHUNKS=1,
                     **variant.kernel_constants())
    types = dict(a_desc=nvmma_descriptor(dtype, (1, bk, bm)), b_desc=nvmma_descriptor(dtype, (1, bk, bn)),
                 c_desc=nvmma_descriptor(dtype, (1, bm, variant.epilogue_n)))
    compiled = compile_warp_specialized(constants, types, variant)
    assert ".or.b32" in compiled.asm["ptx"]  # the offs check


@pytest.mark.parametrize("a_row_major,b_row_major", [(True, True), (True, False)])
def test_warp_specialized_kernel_compiles_with_k_chunks(a_row_major, b_row_major):
    """Batch-invariant launches on the 128x128 tile: K in chunks summed in turn by the MMA
    warps, which hold the chunk's accumulator and the running total."""
    bm, bn, bk = tile = (128, 128, 64)
    variant = WARP_SPECIALIZED_TILES[tile]
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SHARDS=1, COUNTER_STRIDE=64, CHECKED=False,
                     A_ROW_MAJOR=a_row_major, B_ROW_MAJOR=b_row_major, ACTIVATION="none", GATE=False,
                     GROUPS_BLOCK=1, K_CHUNKS=3, bias_ptr=None, bias_desc=None, budget_ptr=None,
                     unit_counts_ptr=None, offs_ptr=None, **variant.kernel_constants())
    types = dict(a_desc=nvmma_descriptor("bf16", (1, bm, bk) if a_row_major else (1, bk, bm)),
                 b_desc=nvmma_descriptor("bf16", (1, bk, bn) if b_row_major else (1, bn, bk)),
                 c_desc=nvmma_descriptor("bf16", (1, bm, variant.epilogue_n)))
    compile_warp_specialized(constants, types, variant)


class _FakeHopperDriver:
    """Just enough of a CUDA driver for a jit function to bind its arguments and compile on a
    CPU-only machine: device 0, stream 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return HOPPER


@pytest.mark.parametrize("b_t,bias,batches", [(False, None, 1), (True, "row", 1), (True, None, 3),
                                              (False, "whole", 1)])
def test_warp_specialized_launch_binds_and_compiles(b_t, bias, batches, monkeypatch):
    """launch.launch_kernel carries out a warp-specialized plan up to the launch itself (made
    a compile-only warmup): Gluon's host descriptors (a whole bias's too, read ahead), the
    arguments by name, the launch options, Triton's binding and specialization of them, then
    compilation for sm_90."""
    import torch
    from triton.runtime import driver

    from tritonblas_ops import device as devices
    from tritonblas_ops import launch
    from tritonblas_ops.config import TileConfig
    from tritonblas_ops.plan import Kernel, Knobs, Operand, plan

    for fact, value in [("num_compute_units", 132), ("has_tma", True), ("has_wgmma", True), ("default_num_shards", 2)]:
        monkeypatch.setattr(devices, fact, lambda device, value=value: value)
    kernel = warp_specialized_matmul_kernel
    compiled = []
    real_run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: compiled.append(
        (grid, real_run(*args, grid=grid, warmup=True, **kwargs))))
    m, n, k = 1000, 1024, 520
    a = torch.empty(batches, m, k, dtype=torch.bfloat16)
    b = torch.empty(batches, n, k, dtype=torch.bfloat16).mT if b_t else torch.empty(batches, k, n, dtype=torch.bfloat16)
    c = torch.empty(batches, m, n, dtype=torch.bfloat16)
    bias_t = {None: None, "row": torch.empty(n, dtype=torch.bfloat16),
              "whole": torch.empty(m, n, dtype=torch.bfloat16)}[bias]
    tile = TileConfig(128, 256, 64)
    cuda_plan = plan(Operand.of(a, traced=False), Operand.of(b, traced=False),
                     Operand.bias(bias_t) if bias else None, batched=True, dtype=a.dtype,
                     device=torch.device("cuda", 0), alpha_zero=False, beta_zero=False, tf32=False,
                     knobs=Knobs(tile, num_programs=16), checked=True, warp_specialize=True)
    assert cuda_plan.kernel is Kernel.WARP_SPECIALIZED and cuda_plan.prefetch_bias is (bias == "whole")
    previous = driver._active
    driver.set_active(_FakeHopperDriver())
    try:
        counters = torch.zeros(cuda_plan.queue.numel, dtype=torch.int32)
        launch.launch_kernel(cuda_plan, a, b, c, bias_t, counters, None, 1.0, 1.0)
    finally:
        driver.set_active(previous)
    (grid, binary), = compiled
    assert grid == (16,) and "setmaxnreg" in binary.asm["ptx"]
    assert binary.metadata.num_warps == 12  # the 8 MMA warps and the loader's warpgroup

"""Tensor parallelism (tritonblas_ops/distributed.py): the ops on DTensors, eagerly and compiled.

Two processes (gloo, CPU) run a column-parallel then row-parallel MLP, and each checks
single ops against the sharding rules. Each rank saves what it saw (outputs, full gradients,
placements, the local GEMMs the kernel ran, the routed calls in its generated code); this
process, the single-process reference, compares them with its own run of the same models.

The worker is this file run as a script (`python test_distributed.py OUT_DIR` with RANK and
WORLD_SIZE set), so the ranks start clean and a hang is killed by a timeout, not waited on.
"""

import contextlib
import dataclasses
import datetime
import importlib
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import tritonblas_ops
import tritonblas_ops.distributed

if not torch.distributed.is_available():
    pytest.skip("torch is built without torch.distributed", allow_module_level=True)
from tritonblas_ops.testing import REL_TOLERANCE, assert_matches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZE = 2
TIMEOUT_S = 300  # for both ranks together; a normal run takes well under half of it
ROUTED_CALL = re.compile(r"torch\.ops\.tritonblas\.(ws_\w+)\.default\(")

# Small shapes: the CPU runs the kernel through Triton's interpreter.
BATCH, IN, HIDDEN, OUT = 8, 16, 32, 24  # HIDDEN and OUT split evenly over the ranks
TOLERANCE = REL_TOLERANCE[torch.float32]


class WsLinear(nn.Linear):
    """nn.Linear whose forward calls the ops itself (parallelize_module wants an nn.Linear)."""

    def forward(self, x):
        if self.bias is None:
            return torch.ops.tritonblas.ws_mm(x, self.weight.t())
        return torch.ops.tritonblas.ws_addmm(self.bias, x, self.weight.t())


class MLP(nn.Module):
    def __init__(self, linear: type[nn.Linear], fc2_bias: bool):
        super().__init__()
        self.fc1 = linear(IN, HIDDEN)
        self.fc2 = linear(HIDDEN, OUT, bias=fc2_bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    linear: type[nn.Linear]
    fc2_bias: bool
    compiled: bool


CASES = [
    Case("eager_ops", WsLinear, fc2_bias=True, compiled=False),  # ws_addmm, Partial + bias
    Case("eager_ops_no_fc2_bias", WsLinear, fc2_bias=False, compiled=False),  # ws_mm
    Case("compiled_linear", nn.Linear, fc2_bias=True, compiled=True),  # routed aten GEMMs
    Case("compiled_ops", WsLinear, fc2_bias=True, compiled=True),  # the rules under compile
]


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op on DTensors: placements "R", "S<dim>" or "P" (Partial, sum) per input; the
    output placement the rules give, or None where DTensor picks among redistributions."""
    op: str
    shapes: tuple
    placements: tuple
    expected: str | None
    kwargs: tuple = ()

    @property
    def name(self):
        args = [f"{placement}:{'x'.join(map(str, shape))}"
                for placement, shape in zip(self.placements, self.shapes)]
        args += [f"{k}={v}" for k, v in self.kwargs]
        return f"{self.op}({','.join(args)})"


MK, KN, N, M1, ONE_N, MN = (8, 16), (16, 24), (24,), (8, 1), (1, 24), (8, 24)
BMK, BKN = (4, 8, 16), (4, 16, 24)
OP_CASES = [
    # ws_mm: the aten.mm rules
    OpCase("ws_mm", (MK, KN), ("R", "R"), "R"),
    OpCase("ws_mm", (MK, KN), ("S0", "R"), "S0"),  # sharded activations
    OpCase("ws_mm", (MK, KN), ("R", "S1"), "S1"),  # column-wise weight
    OpCase("ws_mm", (MK, KN), ("S1", "S0"), "P"),  # row-wise weight
    OpCase("ws_mm", (MK, KN), ("P", "R"), "P"),
    OpCase("ws_mm", (MK, KN), ("R", "P"), "P"),
    OpCase("ws_mm", (MK, KN), ("S0", "S0"), None),  # no rule: DTensor redistributes
    OpCase("ws_mm", ((7, 16), KN), ("S0", "R"), "S0"),  # uneven shards: 4 and 3 rows
    OpCase("ws_mm", ((8, 15), (15, 24)), ("S1", "S0"), "P"),
    # ws_addmm: the bias follows the output through broadcasting
    OpCase("ws_addmm", (N, MK, KN), ("R", "R", "S1"), "S1"),  # the bias is split too
    OpCase("ws_addmm", (N, MK, KN), ("S0", "R", "S1"), "S1"),  # as ColwiseParallel has it
    OpCase("ws_addmm", (N, MK, KN), ("R", "S1", "S0"), "P"),  # bias added once
    OpCase("ws_addmm", (N, MK, KN), ("R", "S1", "S0"), "P", (("beta", 0.5), ("alpha", 2.0))),
    OpCase("ws_addmm", (ONE_N, MK, KN), ("R", "S0", "R"), "S0"),  # broadcast along M
    OpCase("ws_addmm", (M1, MK, KN), ("R", "S0", "R"), "S0"),
    OpCase("ws_addmm", (MN, MK, KN), ("R", "R", "S1"), "S1"),
    OpCase("ws_addmm", (N, MK, KN), ("R", "P", "R"), "P"),
    OpCase("ws_addmm", ((23,), MK, (16, 23)), ("R", "R", "S1"), "S1"),  # 12 and 11 columns
    # ws_bmm: the batch dimension too
    OpCase("ws_bmm", (BMK, BKN), ("R", "R"), "R"),
    OpCase("ws_bmm", (BMK, BKN), ("S0", "S0"), "S0"),
    OpCase("ws_bmm", (BMK, BKN), ("S1", "R"), "S1"),
    OpCase("ws_bmm", (BMK, BKN), ("R", "S2"), "S2"),
    OpCase("ws_bmm", (BMK, BKN), ("S2", "S1"), "P"),
]


def make_model(case: Case) -> MLP:
    torch.manual_seed(0)  # every rank and the reference build the same weights
    return MLP(case.linear, case.fc2_bias)


def make_input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, IN, requires_grad=True)


def reference(case: Case) -> dict:
    """The single-process run: the same model and input on plain tensors, eagerly."""
    model = make_model(case)
    x = make_input()
    out = model(x)
    out.sum().backward()
    return {"out": out.detach(), "x.grad": x.grad,
            **{f"{name}.grad": p.grad for name, p in model.named_parameters()}}


def op_inputs(case: OpCase) -> list[torch.Tensor]:
    torch.manual_seed(2)
    return [torch.randn(shape) for shape in case.shapes]


def run_op(case: OpCase, inputs: list[torch.Tensor]) -> torch.Tensor:
    return getattr(torch.ops.tritonblas, case.op)(*inputs, **dict(case.kwargs))


def op_reference(case: OpCase) -> dict:
    inputs = [t.requires_grad_() for t in op_inputs(case)]
    out = run_op(case, inputs)
    out.sum().backward()
    return {"out": out.detach(), **{f"grad{i}": t.grad for i, t in enumerate(inputs)}}


# ---------------------------------------------------------------------------------------
# The worker: one rank
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording_launches():
    """The (a's shape, b's shape) of every GEMM the kernel runs, on this rank's local tensors."""
    ops_module = importlib.import_module("tritonblas_ops.ops")
    ws_matmul = ops_module.ws_matmul
    launched = []

    def recording_ws_matmul(a, b, *args, **kwargs):
        launched.append((tuple(a.shape), tuple(b.shape)))
        return ws_matmul(a, b, *args, **kwargs)

    ops_module.ws_matmul = recording_ws_matmul
    try:
        yield launched
    finally:
        ops_module.ws_matmul = ws_matmul


def run_case(case: Case, mesh) -> dict:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    model = parallelize_module(make_model(case), mesh, {
        "fc1": ColwiseParallel(use_local_output=False),
        "fc2": RowwiseParallel(use_local_output=False),
    })
    x = make_input()
    result = {}

    def step(forward):
        out = forward(x)
        out.to_local().sum().backward()  # Replicate: each rank's local sum is the whole loss
        return out

    with recording_launches() as launched:
        if case.compiled:
            out, codes = run_and_get_code(step, torch.compile(model))
            result["routed"] = [ROUTED_CALL.findall(code) for code in codes]
            result["code"] = codes
        else:
            hidden = []  # fc1's outputs (DTensors: use_local_output=False)
            model.fc1.register_forward_hook(lambda module, args, out: hidden.append(out))
            out = step(model)
            result["hidden_placements"] = [placements(h) for h in hidden]
    result["launched"] = launched

    assert isinstance(out, DTensor), type(out)
    result["out_placements"] = placements(out)
    result["out"] = out.full_tensor().detach()
    result["x.grad"] = x.grad
    for name, p in model.named_parameters():
        result[f"{name}.grad"] = p.grad.full_tensor()
        result[f"{name}.grad_placements"] = placements(p.grad)
    return result


def run_op_case(case: OpCase, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    def to_dtensor(full: torch.Tensor, placement: str) -> DTensor:
        if placement == "P":  # each rank holds half of the value
            local = full / mesh.size()
            return DTensor.from_local(local, mesh, [Partial()], run_check=False)
        p = Replicate() if placement == "R" else Shard(int(placement[1:]))
        return distribute_tensor(full, mesh, [p])

    inputs = [to_dtensor(full, placement).requires_grad_()
              for full, placement in zip(op_inputs(case), case.placements)]
    out = run_op(case, inputs)
    out.full_tensor().sum().backward()
    return {
        "out_placements": placements(out),
        "out": out.full_tensor().detach(),
        **{f"grad{i}": t.grad.full_tensor() for i, t in enumerate(inputs)},
    }


def placements(dtensor) -> str:
    """A DTensor's placement on the 1-D mesh as OpCase writes them: "R", "S<dim>" or "P"."""
    (placement,) = dtensor.placements
    if placement.is_replicate():
        return "R"
    if placement.is_shard():
        return f"S{placement.dim}"
    return "P" if placement.is_partial() else str(placement)


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = int(os.environ["RANK"])
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2))
    # `import tritonblas_ops` has registered the rules (test_import_registers_the_rules);
    # registering again is a no-op, and keeps this worker independent of that test.
    tritonblas_ops.distributed.register()
    tritonblas_ops.route_cpu(True)
    mesh = DeviceMesh("cpu", list(range(WORLD_SIZE)))
    results = {}
    try:
        start = time.perf_counter()
        for case in OP_CASES:
            results[case.name] = run_op_case(case, mesh)
        print(f"rank {rank}: op cases took {time.perf_counter() - start:.1f} s", flush=True)
        for case in CASES:
            start = time.perf_counter()
            results[case.name] = run_case(case, mesh)
            print(f"rank {rank}: {case.name} took {time.perf_counter() - start:.1f} s", flush=True)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        # No rank tears gloo down while the other's last messages are in flight: once, in a
        # loaded CI run, a rank aborted after its last case ("terminate called without an
        # active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# The test: two ranks, compared with this process's single-process run
# ---------------------------------------------------------------------------------------


def run_ranks(out_dir) -> list[dict]:
    """Runs the worker on WORLD_SIZE processes; fails with their output if any fails."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(WORLD_SIZE),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        # run_and_get_code must see the code compiled, not loaded from a cache.
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no compile workers on a small CI machine
        "OMP_NUM_THREADS": "1",
    }
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may not resolve in CI
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w+")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(out_dir)],
            env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        ))
        logs.append(log)
    # Wait for both; once one fails, stop the other rather than let it wait in a collective.
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.returncode for proc in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        timed_out = time.monotonic() > deadline
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        report.append(f"--- rank {rank} (exit code {proc.returncode}) ---\n{log.read()[-6000:]}")
        log.close()
    if timed_out or any(proc.returncode != 0 for proc in procs):
        reason = f"timed out after {TIMEOUT_S} s" if timed_out else "a rank failed"
        pytest.fail(f"{reason}\n" + "\n".join(report), pytrace=False)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            for rank in range(WORLD_SIZE)]


def test_import_registers_the_rules(monkeypatch):
    from torch.distributed.tensor import DTensor

    registered = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    ops = [getattr(torch.ops.tritonblas, name).default for name in ("ws_mm", "ws_addmm", "ws_bmm")]
    assert all(op in registered for op in ops), "import tritonblas_ops left the rules out"
    rules = [registered[op] for op in ops]
    assert tritonblas_ops.distributed.register()
    assert [registered[op] for op in ops] == rules, "a second register() replaced the rules"


def test_register_skips_a_torch_without_distributed(monkeypatch):
    monkeypatch.setattr(tritonblas_ops.distributed, "_registered", False)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert tritonblas_ops.distributed.register() is False
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    # DTensor's modules missing (None in sys.modules: importing them raises
    # ModuleNotFoundError) is skipped too; any other error would propagate.
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor.experimental", None)
    assert tritonblas_ops.distributed.register() is False


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("tp"))


def assert_all_match(got: dict, expected: dict, where: str) -> None:
    for key, ref in expected.items():
        try:
            assert_matches(got[key], ref, TOLERANCE)
        except AssertionError as error:
            raise AssertionError(f"{where}, {key}: {error}") from None


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_tensor_parallel_mlp_matches_single_process(rank_results, case):
    expected = reference(case)
    for rank, results in enumerate(rank_results):
        got = results[case.name]
        assert_all_match(got, expected, f"rank {rank}")
        # Column-parallel fc1 (weight and bias Shard(0)), row-parallel fc2 (weight Shard(1),
        # bias replicated): the gradients are placed as the parameters are.
        grad_placements = {"fc1.weight": "S0", "fc1.bias": "S0", "fc2.weight": "S1"}
        if case.fc2_bias:
            grad_placements["fc2.bias"] = "R"
        for name, placement in grad_placements.items():
            assert got[f"{name}.grad_placements"] == placement, (rank, name)
        assert got["out_placements"] == "R", f"rank {rank}: {got['out_placements']}"
        if not case.compiled:
            assert got["hidden_placements"] == ["S1"], f"rank {rank}: {got['hidden_placements']}"


def gemm(m: int, k: int, n: int) -> tuple[int, int, int]:
    """An (M, K) @ (K, N) GEMM, a transposed product (N, K) @ (K, M) counted as the same:
    Inductor computes a Linear's weight gradient as grad.T @ x, the ops' autograd as x.T @ grad."""
    return min(m, n), k, max(m, n)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_runs_the_kernel_on_its_shards(rank_results, case):
    hidden = HIDDEN // WORLD_SIZE  # each rank's columns of fc1, rows of fc2
    expected = sorted([
        gemm(BATCH, IN, hidden),  # fc1
        gemm(BATCH, hidden, OUT),  # fc2: partial sums
        gemm(BATCH, OUT, hidden),  # fc2's input gradient
        gemm(hidden, BATCH, OUT),  # fc2's weight gradient
        gemm(BATCH, hidden, IN),  # fc1's input gradient
        gemm(hidden, BATCH, IN),  # fc1's weight gradient
    ])
    for rank, results in enumerate(rank_results):
        launched = results[case.name]["launched"]
        assert sorted(gemm(*a, b[1]) for a, b in launched) == expected, f"rank {rank}: {launched}"


@pytest.mark.parametrize("case", [c for c in CASES if c.compiled], ids=lambda case: case.name)
def test_compiled_code_calls_the_ops_on_every_rank(rank_results, case):
    for rank, results in enumerate(rank_results):
        got = results[case.name]
        forward, backward = got["routed"]
        assert sorted(forward) == ["ws_addmm", "ws_addmm"], f"rank {rank}:\n{got['code'][0]}"
        assert sorted(backward) == ["ws_mm"] * 4, f"rank {rank}:\n{got['code'][1]}"


@pytest.mark.parametrize("case", OP_CASES, ids=lambda case: case.name)
def test_op_on_dtensors_matches_single_process(rank_results, case):
    expected = op_reference(case)
    for rank, results in enumerate(rank_results):
        got = results[case.name]
        if case.expected is not None:
            assert got["out_placements"] == case.expected, f"rank {rank}: {got['out_placements']}"
        assert_all_match(got, expected, f"rank {rank}")


if __name__ == "__main__":
    worker(sys.argv[1])

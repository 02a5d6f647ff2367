"""The benchmark harness's plumbing, on the CPU (--smoke: the Triton interpreter, tiny
shapes): every provider passes the float64 gate and lands in the CSV."""

import csv
import dataclasses
import json
import math
import os
import pathlib
import shutil
import tarfile

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tritonblas_ops

from benchmarks import bench, corpus, kernel_cache, measure, overhead
from benchmarks.providers import config_name, parse_config


def test_smoke_run_writes_a_row_per_shape_and_provider(tmp_path):
    out = tmp_path / "smoke.csv"
    bench.main(["--smoke", "--configs", "16x16x16w4s1k1,16x32x16w4s1k3t", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    providers = {row["provider"] for row in rows}
    assert providers == {"torch_mm", "static", "ws", "ws_16x16x16w4s1k1", "ws_16x32x16w4s1k3t"}
    assert len(rows) == 2 * len(providers)  # the smoke corpus has two shapes
    assert all(row["dtype"] == "bfloat16" for row in rows)  # the harness's default
    assert all(float(row["rel_err"]) <= measure.TOLERANCE[torch.bfloat16] for row in rows)
    assert all(float(row["p50_ms"]) > 0 for row in rows)


def test_k_major_b_is_passed_as_nn_linear_passes_its_weight(tmp_path):
    shape = corpus.parse_shapes("24x40x56")[0]
    _, b, _, _ = bench._inputs(shape, torch.float32, torch.device("cpu"), bench.K_MAJOR)
    assert b.shape == (56, 40) and b.stride() == (1, 56)
    out = tmp_path / "k_major.csv"
    bench.main(["--smoke", "--dtype", "fp32", "--b-layout", "k-major", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert rows and all(float(row["rel_err"]) <= measure.TOLERANCE[torch.float32] for row in rows)
    # The CSV's columns stay the same; the run's metadata says how B was laid out.
    assert json.loads(out.with_suffix(".json").read_text())[-1]["args"]["b_layout"] == "k-major"


def test_batch_invariant_runs_are_marked_in_the_metadata(tmp_path):
    out = tmp_path / "invariant.csv"
    try:
        bench.main(["--smoke", "--batch-invariant", "--out", str(out)])
    finally:
        tritonblas_ops.batch_invariant(False)
    assert json.loads(out.with_suffix(".json").read_text())[-1]["args"]["batch_invariant"]
    assert all(float(row["rel_err"]) <= measure.TOLERANCE[torch.bfloat16] for row in csv.DictReader(out.open()))


def test_config_names_round_trip_and_bad_ones_are_refused():
    config = parse_config("128x256x64w8s3k2")
    assert (config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages,
            config.split_k) == (128, 256, 64, 8, 3, 2)
    assert config_name(config) == "128x256x64w8s3k2"
    config = parse_config("128x16x128w4s5k2t")
    assert config.swap_ab and config_name(config) == "128x16x128w4s5k2t"
    config = parse_config("128x128x64w4s4k3r")
    assert config.split_tail and not config.swap_ab and config_name(config) == "128x128x64w4s4k3r"
    with pytest.raises(ValueError, match="is not like 128x256x64w8s3k1"):
        parse_config("128x256")


def test_overhead_smoke_run_times_every_provider(tmp_path):
    out = tmp_path / "overhead.csv"
    bench.main(["--smoke", "--overhead", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {row["provider"] for row in rows} == {
        "torch_mm", "ws_op", "ws", "ws_uncached", "ws_checked", overhead.PYTHON_OP_FLOOR,
        "torch_addmm", "ws_addmm_op", "addmm_gelu", "ws_mm_act_op"}
    assert all(0 < float(row["p20_ms"]) <= float(row["p50_ms"]) <= float(row["p80_ms"]) for row in rows)


def test_models_smoke_run_times_every_model_step_and_variant(tmp_path):
    """benchmarks/models.py's plumbing: every (model, step, variant) row lands in the CSV,
    decode has no training step, the routed variants compute what default does, and the
    second compile of default (the spread's control) its very bits."""
    from benchmarks import models

    out = tmp_path / "models.csv"
    models.main(["--smoke", "--models", "gpt2_mlp,decode_8b_t1", "--trials", "1",
                 "--variants", "default,default_again,routed,routed_fused,routed_auto", "--steps-per-trial", "1",
                 "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {(r["model"], r["step"], r["variant"]) for r in rows} == {
        (model, step, variant) for model, step in
        [("gpt2_mlp", "forward"), ("gpt2_mlp", "train"), ("decode_8b_t1", "forward")]
        for variant in ("default", "default_again", "routed", "routed_fused", "routed_auto")}
    assert all(float(r["p50_ms"]) > 0 and float(r["vs_default"]) > 0 for r in rows)
    assert len(json.loads(out.with_suffix(".json").read_text())) == 1  # rows per case, one run
    # The kernel ran (not bitwise Inductor's: on the CPU every policy routes), and agrees.
    routed = [float(r["rel_err"]) for r in rows if r["variant"].startswith("routed")]
    assert all(0 < err < 1e-5 for err in routed)
    assert all(float(r["rel_err"]) == 0 for r in rows if r["variant"] == "default_again")  # the control


def test_models_table_fits_the_longest_model_name():
    """A name longer than the default column (grouped.py's MoE layers) does not run into the step."""
    from benchmarks import models

    def row(model):
        return models.ModelRow(timestamp="t", gpu="g", num_sms=None, torch="", triton="", cuda=None,
                               model=model, step="train", variant="default", cuda_graphs=False,
                               held_sms=0, steps_per_trial=1, p20_ms=1.0, p50_ms=1.0, p80_ms=1.0,
                               vs_default=1.0)

    lines = models.table([row("gpt2_mlp"), row("moe_dsv3_e64_t4096")]).splitlines()
    assert [line.split()[:2] for line in lines] == [["model", "step"], ["gpt2_mlp", "train"],
                                                     ["moe_dsv3_e64_t4096", "train"]]
    assert len({line.index("train") for line in lines[1:]}) == 1  # the columns line up


def test_models_plot_takes_the_newest_row_of_each_case_and_variant():
    """Several models.py calls fill one figure: each (case, variant) from its newest run."""
    from benchmarks import plot

    def row(stamp, model, variant, ratio):
        return {"timestamp": stamp, "model": model, "step": "train", "cuda_graphs": "False",
                "held_sms": "0", "variant": variant, "vs_default": ratio}

    rows = [row("2026-12-05T10:00:00Z", "llama_8b", "routed", "0.96"),
            row("2026-12-05T12:00:00Z", "llama_8b", "routed", "0.98"),
            row("2026-12-05T11:00:00Z", "gpt2_mlp", "routed", "0.90"),
            row("2026-12-05T11:00:00Z", "llama_8b", "routed_auto", "1.0")]
    latest = plot._latest_per_case(rows, None)
    assert sorted((r["model"], r["variant"], r["vs_default"]) for r in latest) == [
        ("gpt2_mlp", "routed", "0.90"), ("llama_8b", "routed", "0.98"), ("llama_8b", "routed_auto", "1.0")]
    assert plot._latest_per_case(rows, "2026-12-05T11:00:00Z") == rows[2:]


def test_handoff_rows_carry_the_idle_floor_and_the_write_time(tmp_path, capsys):
    """benchmarks/handoff.py's plumbing, without a GPU: trials summarized into rows (idle has
    no GEMM times; only the providers that write the budget have a write time), the CSV and
    the table; a CSV of other columns and unknown providers are refused before any trial."""
    from benchmarks import handoff, results

    out = tmp_path / "handoff.csv"
    assert "idle" in handoff.parse_args(["--out", str(out)]).providers
    args = handoff.parse_args(["--out", str(out), "--providers", "ws,ws_live,idle"])
    # Per trial: (request us, wait us, write us, GEMM ms); GEMM-alone ms beside.
    samples = {"ws": [(300.0, 1000.0, None, 1.5), (310.0, 1100.0, None, 1.6), (320.0, 1050.0, None, 1.7)],
               "ws_live": [(300.0, 200.0, 8.0, 1.8), (300.0, 190.0, 6.0, 1.9), (300.0, 250.0, 7.0, 2.0)],
               "idle": [(205.0, 100.0, 5.0, None), (205.0, 90.0, 4.0, None), (205.0, 95.0, 6.0, None)]}
    alone = {"ws": [1.4, 1.5, 1.6], "ws_live": [1.5, 1.6, 1.7], "idle": [None, None, None]}
    env = results.environment(torch.device("cpu"), vars(args))
    rows = [handoff.HandoffRow(**results.run_fields(env), **r)
            for r in handoff.summarize("8x8x8", 16, "high", samples, alone)]
    results.append(out, rows, env)
    written = {r["provider"]: r for r in csv.DictReader(out.open())}
    assert set(written) == {"ws", "ws_live", "idle"}
    live, idle = written["ws_live"], written["idle"]
    assert (live["wait_us"], live["wait_max_us"], live["write_us"], live["gemm_alone_ms"]) == ("200.0", "250.0", "7.0", "1.6")
    assert (idle["wait_us"], idle["write_us"], idle["gemm_ms"], idle["gemm_alone_ms"]) == ("95.0", "5.0", "", "")
    assert written["ws"]["write_us"] == ""
    print(handoff.table(rows))
    idle_line = next(line for line in capsys.readouterr().out.splitlines() if " idle " in line)
    assert idle_line.split()[-2:] == ["-", "-"] and "95" in idle_line.split()
    handoff.parse_args(["--out", str(out)])  # the same columns: appending is fine

    old = tmp_path / "old.csv"  # the first run's columns, before write_us
    old.write_text(",".join(f.name for f in dataclasses.fields(handoff.HandoffRow) if f.name != "write_us") + "\n")
    with pytest.raises(SystemExit):
        handoff.parse_args(["--out", str(old)])
    with pytest.raises(SystemExit):
        handoff.parse_args(["--out", str(out), "--providers", "ws,nope"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            handoff.main(["--out", str(out)])


def test_a_stalled_handoff_trial_is_reported_not_waited_for(monkeypatch):
    """The handoff harness waits for a trial's streams at most TRIAL_TIMEOUT_S and then
    names the setting, instead of hanging in torch.cuda.synchronize()."""
    from benchmarks import handoff

    class Event:  # a stand-in for torch.cuda.Event: done after `polls` queries, or never
        polls = None

        def record(self, stream):
            self.left = Event.polls

        def query(self):
            if self.left is None:
                return False
            self.left -= 1
            return self.left < 0

    monkeypatch.setattr(handoff.torch.cuda, "Event", Event)
    monkeypatch.setattr(handoff, "TRIAL_TIMEOUT_S", 0.05)
    Event.polls = 3
    handoff._finish(["main", "late"], "finishes")
    Event.polls = None
    with pytest.raises(TimeoutError, match="8x8x8, ws_live, H = 8"):
        handoff._finish(["main", "late"], "8x8x8, ws_live, H = 8")


def test_epilogues_smoke_run_times_every_way_and_checks_the_gated_product(capsys):
    """benchmarks/epilogues.py's plumbing: one line per shape, every way timed, the gated
    product right against float64."""
    from benchmarks import epilogues

    epilogues.main(["--smoke"])
    line = capsys.readouterr().out.splitlines()[-1]
    shape, _, error, *fields = line.split("|")[0].split()
    assert shape == epilogues.SMOKE_SHAPES and float(error) <= measure.TOLERANCE[torch.float32]
    times = dict(field.split("=") for field in fields)
    assert set(times) == {"mm", "ws_mm", "gated", "gated_dgelu", "addmm_res", "torch_addmm", "eager_gated"}
    assert all(float(us) > 0 for us in times.values())


def test_grouped_smoke_run_gates_and_times_every_provider(tmp_path):
    """benchmarks/grouped.py's plumbing: every smoke case, both GEMMs (the MoE forward, 2-D x
    3-D, and its weight gradient, 2-D x 2-D) and every provider has a row that passed the
    float64 gate; the group sizes, seeded, land in the run's metadata."""
    from benchmarks import grouped

    out = tmp_path / "grouped.csv"
    grouped.main(["--smoke", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert sorted((r["case"], r["kind"], r["provider"]) for r in rows) == sorted(
        (case.name, kind, provider) for case in grouped.SMOKE_CASES for kind in grouped.KINDS
        for provider in grouped.PROVIDERS)
    assert all(r["mode"] == "gemm" and r["dtype"] == "float32" for r in rows)
    assert all(float(r["rel_err"]) <= measure.TOLERANCE[torch.float32] for r in rows)
    assert all(float(r["p50_ms"]) > 0 and float(r["vs_torch_grouped_mm"]) > 0 for r in rows)
    assert any(int(r["empty_groups"]) > 0 for r in rows)  # the skewed case has an empty group
    sizes = json.loads(out.with_suffix(".json").read_text())[-1]["group_sizes"]
    assert sizes == {case.name: grouped.group_sizes(case) for case in grouped.SMOKE_CASES}
    for case in grouped.SMOKE_CASES:
        assert sum(sizes[case.name]) == case.tokens * case.shape.top_k


def test_grouped_gate_fails_a_wrong_group_and_a_written_empty_group():
    """The gate compares rows of every group, and wants an empty group's weight gradient
    exactly zero."""
    from benchmarks import grouped

    case = grouped.parse_cases("tiny_t40_skewed")[0]
    sizes = grouped.group_sizes(case)
    assert 0 in sizes
    for kind in grouped.KINDS:
        p = grouped.problem(case, kind, sizes, torch.float32, torch.device("cpu"))
        rows = grouped.check_rows(p)
        ref = grouped.reference(p, rows)
        right = grouped.mm_loop(p)
        assert grouped.verified_error(right, p, rows, ref, "loop") < 1e-5
        last = max(g for g, (begin, end) in enumerate(p.bounds) if end > begin)

        def wrong_last_group():
            out = right()
            if kind == grouped.FORWARD:
                begin, end = p.bounds[last]
                out[begin:end] *= 2
            else:
                out[last] *= 2
            return out

        with pytest.raises(AssertionError, match="relative error"):
            grouped.verified_error(wrong_last_group, p, rows, ref, "wrong")
    empty = sizes.index(0)

    def written_empty_group():  # too little for the relative error to notice
        out = right()
        out[empty, 0, 0] = 1e-3
        return out

    with pytest.raises(AssertionError, match=f"group {empty} has no rows"):
        grouped.verified_error(written_empty_group, p, rows, ref, "wgrad")


def test_grouped_moe_layer_smoke_run_times_default_and_routed(tmp_path):
    """--moe-layer: a compiled MoE layer's training step, default Inductor and routed, in
    benchmarks/models.py's rows."""
    from benchmarks import grouped

    out = tmp_path / "moe.csv"
    grouped.main(["--smoke", "--moe-layer", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {(r["model"], r["step"], r["variant"]) for r in rows} == {
        ("moe_tiny_t16", "train", variant) for variant in ("default", "routed")}
    assert all(float(r["p50_ms"]) > 0 and float(r["rel_err"]) < 1e-2 for r in rows)


def test_policy_measurements_are_the_recorded_runs():
    """tritonblas_ops/measured.py is what `python -m benchmarks.policy_table` writes from
    benchmarks/results/ now: a new corpus run without regenerating it fails here."""
    from benchmarks import policy_table

    assert policy_table.MODULE.read_text() == policy_table.module_text()


def test_policy_bandwidth_is_the_best_of_the_runs_the_shapes_come_from():
    """A later run of a few small shapes (`--corpus models`) supplies its shapes, and leaves the
    best torch.mm bandwidth to the full run that reached it; a run no shape comes from counts
    for nothing."""
    from benchmarks import policy_table

    def row(stamp, m, provider, gbps):
        return dict(timestamp=stamp, mode="gemm", provider=provider, m=m, n=64, k=64, p50_ms=1.0, gbps=gbps)

    rows = [row("1-full", 1, "torch_mm", 4000.0), row("1-full", 1, "ws", 3900.0),
            row("1-full", 2, "torch_mm", 900.0), row("1-full", 2, "ws", 800.0),
            row("2-small", 2, "torch_mm", 1300.0), row("2-small", 2, "ws", 1200.0),
            row("3-mm-only", 3, "torch_mm", 9000.0)]
    stamps = sorted({stamp for _, stamp in policy_table._latest_per_shape(rows, "ws")})
    assert stamps == ["1-full", "2-small"]
    assert policy_table._best_bandwidth([(rows, stamp) for stamp in stamps]) == 4000.0


def test_policy_takes_the_default_kernels_rows_first():
    """bf16's shapes come from the run that timed the default (warp-specialized) kernel, under
    its own provider name; the main file adds only the shapes that run lacks, and a run
    none of its shapes come from is not listed."""
    from benchmarks import policy_table

    def row(stamp, m, provider, p50_ms):
        return dict(timestamp=stamp, mode="gemm", provider=provider, m=m, n=64, k=64, p50_ms=p50_ms, gbps=1.0)

    default = [row("2-ws", 1, "torch_mm", 1.0), row("2-ws", 1, "ws", 1.2), row("2-ws", 1, "ws_warp_specialized", 0.9)]
    main_file = [row("1-full", 1, "torch_mm", 1.0), row("1-full", 1, "ws", 1.1),
                 row("3-models", 2, "torch_mm", 2.0), row("3-models", 2, "ws", 2.2)]
    files = [("ws.csv", default, "ws_warp_specialized"), ("main.csv", main_file, "ws")]
    shapes, runs = policy_table._dtype_shapes(files, preferred=True)
    assert shapes == [(1, 64, 64, 1000.0, 900.0), (2, 64, 64, 2000.0, 2200.0)]
    assert [(name, stamp) for name, _, stamp in runs] == [("ws.csv", "2-ws"), ("main.csv", "3-models")]
    both, _ = policy_table._dtype_shapes(files, preferred=False)  # fp32's two layouts: every row of each
    assert len(both) == 3


def test_swap_bits_probe_reports_equal_bits_and_catches_a_different_order(capsys):
    """benchmarks/swap_bits.py's plumbing: the swapped tile's C against the unswapped one's,
    bit for bit, a line per shape; a config that sums K in another order (two slices) is
    reported as differing, so the probe can tell."""
    from benchmarks import swap_bits
    from tritonblas_ops.config import TileConfig

    assert swap_bits.main(["--smoke"]) == 0
    assert "4x48x64 (M = 1..4): bitwise equal" in capsys.readouterr().out
    torch.manual_seed(0)
    split = TileConfig(16, 16, 16, num_warps=4, num_stages=1, split_k=2)
    differ = swap_bits.differing_rows(4, 48, 64, torch.float32, torch.device("cpu"),
                                      swap_bits.SMOKE_UNSWAPPED, (split,))
    assert differ and all(line.endswith("16x16") for line in differ)


def test_models_count_every_kernel_the_package_launches():
    """models.py's work-stealing kernel count matches the profiler's names of all three kernels."""
    from benchmarks import models
    from tritonblas_ops.grouped_kernel import ws_grouped_kernel
    from tritonblas_ops.kernel import ws_matmul_kernel
    from tritonblas_ops.warp_specialized_kernel import warp_specialized_matmul_kernel

    names = {kernel.fn.__name__ for kernel in (ws_matmul_kernel, warp_specialized_matmul_kernel, ws_grouped_kernel)}
    assert names == set(models.WS_KERNELS)


def test_grouped_pointer_loads_provider_on_request(tmp_path):
    """ws_pointer_loads (the kernel without tensor descriptors, to price the weight
    gradient's per-tile descriptors) passes the same gate; it is not in the default list."""
    from benchmarks import grouped

    out = tmp_path / "grouped.csv"
    grouped.main(["--smoke", "--cases", "tiny_t40_skewed", "--kinds", "wgrad",
                  "--providers", "ws,ws_pointer_loads", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["provider"] for r in rows) == ["ws", "ws_pointer_loads"]
    assert all(float(r["rel_err"]) < 1e-5 for r in rows)
    assert grouped.WS_POINTER_LOADS not in grouped.PROVIDERS


def test_grouped_triton_kernel_provider_on_request(tmp_path):
    """ws_triton_kernel (the warp-specialized kernel's setting off, for its weight gradients'
    side by side) passes the same gate and leaves the setting as it was."""
    from benchmarks import grouped

    out = tmp_path / "grouped.csv"
    before = tritonblas_ops.is_warp_specializing()
    grouped.main(["--smoke", "--cases", "tiny_t40_skewed", "--kinds", "wgrad",
                  "--providers", "ws,ws_triton_kernel", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["provider"] for r in rows) == ["ws", "ws_triton_kernel"]
    assert all(float(r["rel_err"]) < 1e-5 for r in rows)
    assert tritonblas_ops.is_warp_specializing() == before


def test_epilogues_benchmark_says_it_needs_a_gpu(monkeypatch):
    """benchmarks.epilogues times CUDA kernels only: without a GPU it stops with a message,
    before drawing any operand."""
    from benchmarks import epilogues

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        epilogues.main(["--shapes", "64x64x64"])


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


@pytest.mark.parametrize("binary_only", ["1", "0"])
def test_kernel_cache_archive_gives_triton_a_cache_hit(tmp_path, monkeypatch, binary_only):
    """A kernel compiled (for sm_90, on the CPU) into the cache, archived, the cache
    deleted and restored from the archive: Triton's next compile of it is a cache hit,
    though the archive left the compile's IR out (its `.source` always, the stages' IR
    where Triton stored it)."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("TRITON_STORE_BINARY_ONLY", binary_only)
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))

    def compile_kernel():
        signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
        source = ASTSource(_scale_kernel, signature, {(_scale_kernel.arg_names.index("BLOCK"),): 64})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))

    compile_kernel()
    archive = tmp_path / kernel_cache.ARCHIVE
    assert kernel_cache.save(str(cache_dir), str(archive))
    stored = {path.suffix for path in cache_dir.rglob("*") if path.is_file()}
    assert ".source" in stored and (".ptx" in stored) == (binary_only == "0")
    with tarfile.open(archive) as tar:
        archived = {pathlib.PurePath(name).suffix for name in tar.getnames()}
    assert archived == {"", ".cubin", ".json"}  # the entry's folder, the binary, metadata and group
    shutil.rmtree(cache_dir)
    assert kernel_cache.restore(str(archive), str(cache_dir)) == 1
    compiled = compile_kernel()
    assert hits == [False, True]
    assert compiled.asm["cubin"] and "ptx" not in compiled.asm and "source" not in compiled.asm


def test_kernel_cache_keeps_the_newest_entries_that_fit(tmp_path):
    cache_dir = tmp_path / "cache"
    for age, entry in enumerate(["new", "mid", "old"]):
        (cache_dir / entry).mkdir(parents=True)
        member = cache_dir / entry / "kernel.cubin"
        member.write_bytes(os.urandom(400_000))  # incompressible
        os.utime(member, (1e9 - age, 1e9 - age))
    archive = tmp_path / kernel_cache.ARCHIVE
    assert kernel_cache.save(str(cache_dir), str(archive), max_mib=1) == ["new", "mid"]
    assert kernel_cache.restore(str(archive), str(tmp_path / "restored")) == 2
    assert (tmp_path / "restored" / "new" / "kernel.cubin").read_bytes() == (cache_dir / "new" / "kernel.cubin").read_bytes()
    assert kernel_cache.save(str(cache_dir), str(tmp_path / "none.tar.xz"), max_mib=0.1) == []


def test_models_tally_each_kernel_launches_and_gpu_time():
    """The run's metadata gets each GPU kernel's launches and microseconds per profiled
    step; host events and copies are left out."""
    from types import SimpleNamespace

    from benchmarks import models

    def event(name, device, start, end):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: end - start))

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [event("ws_matmul_kernel", cuda, 0, 7.25), event("triton_poi_fused", cuda, 8, 10),
              event("ws_matmul_kernel", cuda, 11, 14.5), event("Memcpy HtoD", cuda, 15, 16),
              event("aten::mm", cpu, 0, 20)]
    assert models.tally_kernels(events) == {"ws_matmul_kernel": [2, 10.8], "triton_poi_fused": [1, 2.0]}
    # Over two steps: per step, a launch count that does not divide kept as a fraction
    assert models.tally_kernels(events, steps=2) == {"ws_matmul_kernel": [1, 5.4], "triton_poi_fused": [0.5, 1.0]}


def test_results_keep_what_a_run_adds_to_its_environment_as_it_goes(tmp_path):
    """A run appending case by case keeps one JSON record, rewritten at each append (the
    kernel names models.py adds after its first case were lost); the next run gets its own."""
    from benchmarks import results

    @dataclasses.dataclass
    class Row:
        case: str
        ms: float

    out = tmp_path / "rows.csv"
    first = {"timestamp": "2026-12-07T08:00:00Z", "kernels": {"a": {"k": [1, 2.0]}}}
    results.append(out, [Row("a", 1.0)], first)
    first["kernels"]["b"] = {"k": [2, 4.0]}
    results.append(out, [Row("b", 2.0)], first)
    results.append(out, [Row("c", 3.0)], {"timestamp": "2026-12-07T09:00:00Z", "kernels": {}})
    runs = json.loads(out.with_suffix(".json").read_text())
    assert [run["timestamp"] for run in runs] == ["2026-12-07T08:00:00Z", "2026-12-07T09:00:00Z"]
    assert set(runs[0]["kernels"]) == {"a", "b"}
    assert [r["case"] for r in csv.DictReader(out.open())] == ["a", "b", "c"]


def test_models_trials_time_windows_of_at_least_min_window_ms():
    """Short steps get more of them per trial (a window of MIN_WINDOW_MS), long ones the
    requested count; the CPU smoke run (no unheld time) keeps the request."""
    from benchmarks import models

    assert models.steps_per_trial(10, 0.2) == math.ceil(models.MIN_WINDOW_MS / 0.2) > 10
    assert models.steps_per_trial(10, 17.7) == 10
    assert models.steps_per_trial(3, None) == 3

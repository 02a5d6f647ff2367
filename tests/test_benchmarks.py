"""The benchmark harness's plumbing, on the CPU (--smoke: the Triton interpreter, tiny
shapes): every provider passes the float64 gate and lands in the CSV."""

import csv
import json

import pytest
import torch

import tritonblas_ops

from benchmarks import bench, corpus, measure, overhead
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
    with pytest.raises(ValueError, match="is not like 128x256x64w8s3k1"):
        parse_config("128x256")


def test_overhead_smoke_run_times_every_provider(tmp_path):
    out = tmp_path / "overhead.csv"
    bench.main(["--smoke", "--overhead", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {row["provider"] for row in rows} == {
        "torch_mm", "ws_op", "ws", "ws_uncached", "ws_checked", overhead.PYTHON_OP_FLOOR}
    assert all(0 < float(row["p20_ms"]) <= float(row["p50_ms"]) <= float(row["p80_ms"]) for row in rows)


def test_models_smoke_run_times_every_model_step_and_variant(tmp_path):
    """benchmarks/models.py's plumbing: every (model, step, variant) row lands in the CSV,
    decode has no training step, and the routed variant computes what default does."""
    from benchmarks import models

    out = tmp_path / "models.csv"
    models.main(["--smoke", "--models", "gpt2_mlp,decode_8b_t1", "--trials", "1",
                 "--steps-per-trial", "1", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {(r["model"], r["step"], r["variant"]) for r in rows} == {
        (model, step, variant) for model, step in
        [("gpt2_mlp", "forward"), ("gpt2_mlp", "train"), ("decode_8b_t1", "forward")]
        for variant in ("default", "routed")}
    assert all(float(r["p50_ms"]) > 0 and float(r["vs_default"]) > 0 for r in rows)
    routed = [float(r["rel_err"]) for r in rows if r["variant"] == "routed"]
    assert all(0 < err < 1e-5 for err in routed)  # the kernel ran (not bitwise Inductor's), and agrees

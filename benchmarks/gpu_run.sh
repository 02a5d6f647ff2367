#!/usr/bin/env bash
# Everything that needs the GPU, in one call: GPU tests, then the benchmarks, logs under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_run.sh [tests] [ws_tests] [integration] [deploy] [sweep] [sweep_splits] [sweep_decode] [bench] [bench_models] [epilogues] [swap_bits] [contention] [overhead] [models_small] [models_8b] [models_auto] [handoff] [overlap] [dtypes] [ab] [grouped] [grouped_ab] [grouped_moe] [invariant]
# Rough times on the H200 (a fresh machine compiles every kernel): tests (the kernel's, tests/test_gpu.py) ~5 min,
# integration (every other -m gpu test but the deployment ones: routing, reliability, ...) ~4 min (since the
# warp-specialized kernel, 2026-12-05 on a fresh H100: tests ~6 min, ws_tests, its tests and the grouped GEMM's,
# ~3, integration without them ~5; give tests a call of its own; each test stage's limit: TESTS_TIMEOUT, 560 s;
# TESTS_K, a pytest -k expression, picks some of the kernel's tests),
# deploy ~4 min (AOTInductor compiles), bench ~2 min (68 shapes; 51 took ~1.5 min; merge its rows into benchmarks/results/
# and run `python -m benchmarks.policy_table` to refresh policy "auto"'s measurements), contention ~1 min, sweep (tile configs for select_config) ~5 min before its `models` line was added (not yet timed with it), the rest
# under a minute each (handoff, the live budget's wait with an idle floor: ~1 min); one device call may run 10 minutes. models_small and models_8b (benchmarks/models.py,
# not in the default list) compile every variant per model, step and graph mode: ~15 s each (one llama_8b run),
# so roughly 12 and 3 minutes; their stage times are not measured yet. `ab` (not in the default list) compares this tree
# with another checkout in .baseline/ (git archive <commit> tritonblas_ops benchmarks | tar -x -C .baseline):
# host time and output bits (benchmarks/ab.py), then the baseline's corpus (run `bench` beside it), ~3 min.
# grouped (benchmarks/grouped.py: MoE grouped GEMMs, ws against torch._grouped_mm and a torch.mm loop, alone and
# with 16 and 33 SMs held) took under 2.5 min on the H200 (2026-12-05); grouped_moe (not in the default list: a
# compiled MoE layer's training step, default vs routed) about 1 min with --held 0,16.
# epilogues (benchmarks/epilogues.py: fused gate and residual epilogues, printed only, ~30 s on the
# H200) is not in the default list.
# bench_models (the corpus's `models` group alone, the Triton kernel beside the default, ~1 min: what
# policy "auto" lacks for the model benchmark; merge and regenerate as for bench) and models_auto (the
# model benchmark's policy and fusion variants against default Inductor, CUDA graphs on and off: on the
# H200 ~1.3 min for the four small models and ~1.5 min for llama_8b, 2026-12-05; with default compiled a
# second time beside them since 2026-12-07, the spread's control, about a third more) are not in the default
# list either.
# invariant (not in the default list, ~4 min on an H100): batch-invariant mode on 26 shapes (decode,
# skinny, K-heavy, small, big), then the quick corpus with and without the mode, one after the other.
# Timed on an H100 with the kernel cache carried (2026-12-07, five calls: 466, 230, 340, 355, 231 s):
# ws_tests ~3 min, grouped ~1.5, grouped_moe ~1.5; bench and invariant ~3.5 together; tests with
# TESTS_K="split or exactly_once or invariant or chunks" 2 min, models_auto ~3.5; deploy ~3, then
# overhead, contention and handoff ~1.5 together; overlap and dtypes ~2.5; saving the kernel cache
# at the end ~1 min (before IR was left out of the archive, ~1.5). On the H200 with the cache carried
# (2026-12-07): ws_tests grouped grouped_moe 264 s, bench contention 90 s, handoff invariant 94 s.
# On an H100 with the cache (2026-12-07, twenty-seventh session): swap_bits bench 82 s, sweep_decode
# 50-75 s, swap_bits invariant plus tests with TESTS_K="invariant or chunks or swap or decode" 124 s.
# On a fresh H100, no cache (2026-12-07, twenty-ninth session): sweep_decode 100 s, bench 98 s, tests
# with TESTS_K="decode or swap or split_k_shapes" (55 tests) over 190 s (41 done by then).
# On a fresh H100 (2026-12-08, thirtieth session): sweep_decode (before its last line) and invariant 236 s.
# With no stage named, all of them run. Rows land in $OUT/*.csv, logs in $OUT/*.log, and at the end
# all of them (but the kernel cache) go into $OUT/run.tgz: `tar xzf run.tgz` where the call's files came back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for logs and results}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH=$PWD
# The lent H200 has no expecttest and no network: carry its wheel in .whl/ (see
# benchmarks/README.md) and it is installed here, outside the system site-packages.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# Triton's kernels compiled by the last call (benchmarks/kernel_cache.py): restored first, saved last
export TRITON_CACHE_DIR=/tmp/tritonblas_triton_cache TRITON_STORE_BINARY_ONLY=1
[[ -f .gpu_cache/triton_cache.tar.xz ]] && python3 -m benchmarks.kernel_cache restore .gpu_cache/triton_cache.tar.xz $TRITON_CACHE_DIR
# Result files are named for the card that ran them (the lent kind may come as an H100).
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;;
esac
stages=${*:-tests ws_tests integration deploy bench contention overhead handoff overlap dtypes grouped}
has() { [[ " $stages " == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git rev-parse --short HEAD; date -u; } | tee "$OUT/env.log"
# The package's entry points (backend="tritonblas") need its metadata installed.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1

kernel_tests="tests/test_gpu.py"
ws_tests="tests/test_warp_specialized.py tests/test_grouped.py"
deploy_tests="tests/test_export.py tests/test_csrc_stubs.py"
has tests && timeout ${TESTS_TIMEOUT:-560} python3 -m pytest $kernel_tests -m gpu ${TESTS_K:+-k "$TESTS_K"} -q -p no:cacheprovider -rfEs \
  2>&1 | grep -v "^DEBUG" | tee "$OUT/gpu_tests.log" | tail -15
has ws_tests && timeout ${TESTS_TIMEOUT:-560} python3 -m pytest $ws_tests -m gpu -q -p no:cacheprovider -rfEs \
  2>&1 | grep -v "^DEBUG" | tee "$OUT/ws_tests.log" | tail -15
has integration && timeout ${TESTS_TIMEOUT:-560} python3 -m pytest tests -m gpu -q -p no:cacheprovider -rfEs \
  $(for t in $kernel_tests $ws_tests $deploy_tests; do echo --ignore=$t; done) 2>&1 | grep -v "^DEBUG" \
  | tee "$OUT/integration_tests.log" | tail -15
has deploy && timeout ${DEPLOY_TIMEOUT:-300} python3 -m pytest $deploy_tests -m gpu -q -p no:cacheprovider -rfEs \
  2>&1 | grep -v "^DEBUG" | tee "$OUT/deploy_tests.log" | tail -15
sweep() { python3 -m benchmarks.bench --warmup-ms 10 --rep-ms 40 --shapes "$1" --configs "$2" \
            --out "$OUT/${card}_sweep.csv" 2>&1 | grep -v "^DEBUG" | tee -a "$OUT/sweep.log" | tail -12; }
if has sweep; then  # select_config's calibration: forced tile configs beside its choice
  sweep 4096x4096x4096,8192x8192x8192,4096x14336x4096,4864x8192x4160,2048x14336x4096 \
    128x256x64w8s3k1,128x128x64w8s4k1,128x128x64w4s4k1
  sweep 1000x1000x1000,1024x1024x1024,2048x2048x2048,3000x5000x2000,2049x1023x777 \
    128x128x64w4s4k1,128x128x64w8s4k1,64x128x64w4s4k1,128x64x64w4s4k1,64x64x64w4s4k1,128x256x64w8s3k1,128x128x64w4s4k2
  sweep 256x512x32768,1024x1024x16384,128x8192x8192,64x8192x8192 \
    128x128x64w4s4k4,128x128x64w4s4k8,128x128x64w4s4k16,64x128x64w4s4k4,64x128x64w4s4k8,128x64x64w4s4k8,128x256x64w8s3k2,128x256x64w8s3k4
  sweep 1x28672x8192,1x14336x4096,16x14336x4096,16x28672x8192,16x4096x4096,1x8192x28672,16x4096x14336 \
    128x16x128w4s5k1t,128x16x128w4s5k2t,128x16x128w4s4k4t,128x16x64w4s8k1t,128x32x128w4s4k1t,64x128x128w4s4k1,64x128x64w4s4k1
  # The `models` group's mid-size GEMMs (the small blocks' weight gradients, 0.58-0.73x)
  sweep 1024x2816x4096,2816x1024x4096,768x3072x8192,3072x768x8192,1024x1024x4096 \
    128x128x64w8s4k1,128x128x64w4s4k2,128x128x64w4s4k3,64x128x64w4s4k1,64x128x64w4s4k2,128x64x64w4s4k2,128x256x64w8s3k2,128x256x64w8s3k1,128x64x128w4s4k1
fi
if has sweep || has sweep_splits; then  # sweep_splits (~2 min, not yet timed): the split-K and K-chunk lines alone
  # What a dearer split-K partial (NOTES.md step 54) would pick where nothing measured it yet
  sweep 2048x1024x32768,128x8192x28672 128x256x64w8s3k2,128x256x64w8s3k4,128x128x64w4s4k1,128x128x64w4s4k2
  # Split tails (NOTES.md step 57) beside the unsplit tiles (the warp-specialized kernel's) and uniform splits
  sweep 3072x768x8192,768x3072x8192,1024x2816x4096,2816x1024x4096,2304x1024x8192 \
    128x128x64w4s4k8r,128x128x64w4s4k4r,128x128x64w4s4k3r,128x128x64w4s4k2r,128x256x64w8s3k2r,128x256x64w8s3k1,128x128x64w8s4k1,128x256x64w8s3k3
  # Batch-invariant mode's K chunks (NOTES.md step 58): the old choice, in turn on 128x128, a split tail;
  # 768x3072x8192 has one chunk today (its old choice is 128x256 in the line above): what two would give
  sweep 3072x768x8192,768x3072x8192 128x64x128w4s4k1c2,128x128x64w8s4k1c2,128x128x64w8s4k2c2r
  # and decode of that (N, K) with two chunks: today's tile, the chunks as split-K units, in turn
  sweep 1x3072x8192,16x3072x8192 64x32x256w4s4k1,64x64x128w4s6k2c2,64x32x256w4s4k1c2
fi
if has sweep_decode; then  # (~1.5 min on a fresh H100, 2026-12-07, before its last three lines) batch-invariant decode (NOTES.md step 70):
  # the unswapped 64x32 tile it ran before, and transposed ones with pipelines of 5-11 stages, at the
  # chunk counts of each (N, K)
  sweep 1x4096x14336,16x4096x14336,1x4096x4096,16x4096x4096,1x3072x8192,1x8192x28672,16x1024x4096 \
    64x32x256w4s4k1,64x16x128w4s5k1t,64x16x128w4s8k1t,64x16x128w4s11k1t,128x16x128w4s5k1t,128x16x128w4s6k1t
  sweep 1x1000x14336,16x1000x14336 64x32x256w4s4k4c4,64x16x128w4s5k4c4t,64x16x128w4s8k4c4t,64x16x128w4s11k4c4t
  # the widest weights: the chosen tile's 64 rows make 1.7-3.4 waves of units, normal mode's 128 rows half that
  sweep 1x14336x4096,16x14336x4096,1x28672x8192,16x28672x8192 64x16x128w4s8k1t,128x16x128w4s5k1t,128x16x128w4s6k1t
  # normal mode's decode since step 72: the 64-row tile of 8 stages, whole K, where it is the choice,
  # beside the 128-row tile in the 2-4 K slices those shapes took before
  sweep 1x4096x4096,16x4096x4096,1x6144x4096,1x3072x4096,1x5120x4096,1x8192x4096,1x8192x8192,1x6144x8192 \
    128x16x128w4s5k2t,128x16x128w4s5k3t,128x16x128w4s5k4t
  # N = 1000, K = 14336 in normal mode (its choice, 128 rows in 16 slices, ran 0.90x): fewer slices
  # of 64 rows (NOTES.md step 72; 6 slices since step 73)
  sweep 1x1000x14336,16x1000x14336 64x16x128w4s5k4t,64x16x128w4s5k6t,64x16x128w4s5k8t,128x16x128w4s5k8t
  # 64 rows in 4, 6 and 8 slices on 1024- and 2048-row decode: where more units stop paying,
  # for a bandwidth ceiling in the cost model (NOTES.md step 73)
  sweep 1x1024x4096,16x1024x4096,1x2048x4096,16x2048x4096 \
    64x16x128w4s5k4t,64x16x128w4s5k6t,64x16x128w4s5k8t,128x16x128w4s5k4t
fi
has bench && python3 -m benchmarks.bench --out "$OUT/${card}_bf16.csv" 2>&1 | tee "$OUT/bench.log" | tail -50
has epilogues && python3 -m benchmarks.epilogues 2>&1 | tee "$OUT/epilogues.log" | tail -8
# swap_bits (not in the default list, under a minute): whether swapped decode tiles keep batch
# invariance's bits (NOTES.md step 69)
has swap_bits && python3 -m benchmarks.swap_bits 2>&1 | tee "$OUT/swap_bits.log" | tail -8
has bench_models && python3 -m benchmarks.bench --corpus models --triton-kernel --warmup-ms 10 --rep-ms 30 \
  --out "$OUT/${card}_bf16.csv" 2>&1 \
  | tee "$OUT/bench_models.log" | tail -20
has models_auto && python3 -m benchmarks.models --models gpt2_mlp,llama_small,llama_8b,decode_8b_t1,decode_8b_t16 \
  --variants default,default_again,routed_fused,routed_auto --trials 5 --out "$OUT/${card}_models.csv" 2>&1 | grep -v "^W[0-9]" \
  | tee "$OUT/models_auto.log" | tail -40
has contention && python3 -m benchmarks.bench --contention 0,8,20,33,66 --out "$OUT/${card}_bf16.csv" 2>&1 | tee "$OUT/contention.log" | tail -12
has overhead && python3 -m benchmarks.bench --overhead --out "$OUT/${card}_bf16.csv" 2>&1 | tee "$OUT/overhead.log" | tail -12
for group in small 8b; do
  if has models_$group; then
    [[ $group == small ]] && list=gpt2_mlp,llama_small,decode_8b_t1,decode_8b_t16 || list=llama_8b
    python3 -m benchmarks.models --models $list --variants default,routed,routed_inline,routed_fused,routed_auto --held 0,16,33 \
      --out "$OUT/${card}_models.csv" 2>&1 | grep -v "^W[0-9]" | tee "$OUT/models_$group.log" | tail -40
  fi
done
has handoff && python3 -m benchmarks.handoff --out "$OUT/${card}_handoff.csv" 2>&1 | tee "$OUT/handoff.log" | tail -52
has overlap && python3 -m benchmarks.overlap --hog-sms 16,33 --out "$OUT/${card}_overlap.csv" 2>&1 | tee "$OUT/overlap.log" | tail -20
has grouped && python3 -m benchmarks.grouped --held 0,16,33 --out "$OUT/${card}_grouped.csv" 2>&1 | tee "$OUT/grouped.log" | tail -130
# grouped_ab (not in the default list, ~1.5 min): ws beside the grouped Triton kernel (the setting off) and
# torch._grouped_mm, alone: what moving a layout to the warp-specialized kernel changed, in one run.
has grouped_ab && python3 -m benchmarks.grouped --providers ws,ws_triton_kernel,torch_grouped_mm --held 0 \
  --out "$OUT/${card}_grouped.csv" 2>&1 | tee "$OUT/grouped_ab.log" | tail -40
has grouped_moe && python3 -m benchmarks.grouped --moe-layer --held 0,16,33 --out "$OUT/${card}_grouped_moe.csv" 2>&1 \
  | grep -v "^W[0-9]" | tee "$OUT/grouped_moe.log" | tail -16
if has invariant; then
  invariant_shapes=1x4096x14336,1x14336x4096,16x14336x4096,16x4096x14336,128x4096x14336,1x28672x8192,1x8192x28672
  invariant_shapes+=,16x4096x4096,64x8192x8192,128x8192x8192,1024x1024x16384,256x512x32768,512x512x16384,128x1024x32768
  invariant_shapes+=,1024x1024x1024,1000x1000x1000,8192x1000x4096,6144x2000x3000,2048x2048x2048,4096x4096x4096
  invariant_shapes+=,8192x4096x14336,1x1000x14336,8192x1000x14336,16x1024x4096,3072x768x8192,768x3072x8192
  python3 -m benchmarks.bench --batch-invariant --warmup-ms 10 --rep-ms 30 --shapes $invariant_shapes \
    --out "$OUT/${card}_bf16_invariant.csv" 2>&1 | tee "$OUT/invariant.log" | tail -30
  python3 -m benchmarks.bench --corpus quick --batch-invariant --warmup-ms 10 --rep-ms 30 \
    --out "$OUT/${card}_bf16_invariant.csv" 2>&1 | tee -a "$OUT/invariant.log" | tail -4
  python3 -m benchmarks.bench --corpus quick --warmup-ms 10 --rep-ms 30 --out "$OUT/${card}_bf16.csv" 2>&1 \
    | tee -a "$OUT/invariant.log" | tail -4
fi
if has ab; then
  python3 -m benchmarks.ab --baseline .baseline --fast-paths-off --out "$OUT/ab.json" 2>&1 | tee "$OUT/ab.log" | tail -8
  (cd .baseline && PYTHONPATH=$PWD python3 -m benchmarks.bench --out "$OUT/baseline_bf16.csv" 2>&1 \
    | tee "$OUT/baseline_bench.log" | tail -3)
fi
if has dtypes; then
  for dtype in fp16 fp32; do
    python3 -m benchmarks.bench --corpus quick --dtype $dtype --out "$OUT/${card}_$dtype.csv" 2>&1 | tee "$OUT/bench_$dtype.log" | tail -16
  done
  # TF32 with B laid out as nn.Linear's weight is (K-major: no copy needed)
  python3 -m benchmarks.bench --corpus quick --dtype fp32 --b-layout k-major --out "$OUT/${card}_fp32_kmajor.csv" 2>&1 \
    | tee "$OUT/bench_fp32_kmajor.log" | tail -16
fi
# SAVE_KERNELS=0 skips saving them (~1 min): a call followed by another on the same warm machine,
# whose /tmp the next call finds as this one left it.
if [[ -d $TRITON_CACHE_DIR && ${SAVE_KERNELS:-1} != 0 ]]; then python3 -m benchmarks.kernel_cache save $TRITON_CACHE_DIR "$OUT/triton_cache.tar.xz"; fi
# A device call brings back at most 8 files: everything else in $OUT goes back as one archive
# (built outside $OUT: tar fails on a folder that changes while it reads it).
bundle=$(mktemp -d)/run.tgz
if tar czf "$bundle" -C "$OUT" --exclude=triton_cache.tar.xz --exclude=run.tgz . && mv "$bundle" "$OUT/run.tgz"; then
  find "$OUT" -maxdepth 1 -type f ! -name run.tgz ! -name triton_cache.tar.xz -delete
fi

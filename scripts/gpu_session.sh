#!/usr/bin/env bash
# One GPU session (device tool, H200): correctness at real shapes, then the engine benchmarks, with the
# demo model's training running beside the correctness checks. Every step has its own time limit and a
# failure never stops the next step. Results, logs and the trained model come back under $OUT as a
# tarball split into parts of at most 15 MB (the device tool returns at most 8 files of 16 MB).
#
#   bash scripts/gpu_session.sh            # everything
#   STEPS="kernel_tests latency" bash scripts/gpu_session.sh   # only these steps (plus the checkpoint)
#   SKIP_TRAIN=1 SKIP_SERVE=1 bash scripts/gpu_session.sh
#   STEPS=ncu bash scripts/gpu_session.sh   # the megakernel's stall profile per source line (not in "all")
#   TINYVLLM_GIT_COMMIT=<hash> ...   # the commit to record in the result JSONs (the copy's .git may be stale)
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_lib.sh

# 1. The 1B-shape random checkpoint, once (the engine tests and benches share it).
step checkpoint 120 python3 -c "from tinyvllm.models.checkpoint import resolve_model; print(resolve_model('dummy:llama-3.2-1b'))"

# 2. The demo model trains in the background while the correctness checks run.
TRAIN_PID=
if [ -z "${SKIP_TRAIN:-}" ] && wanted train && [ -f scripts/train_demo_model.py ]; then
  echo "[$(elapsed)s] >>> train (background)"
  (env -u OUT HF_HUB_OFFLINE=1 timeout 240 python3 scripts/train_demo_model.py ${TRAIN_ARGS:---max-minutes 2.6} \
     --out "$WORK/demo" > "$LOGS/train.log" 2>&1; echo "train rc=$?" >> "$LOGS/train.log") &
  TRAIN_PID=$!
fi

# 3. Correctness at real shapes: kernels against the reference, sampler, engine against transformers.
step kernel_tests 150 python3 -m pytest -q -n 8 tests/kernels tests/engine/test_sampler_gpu.py -p no:cacheprovider
step sampling_tests 120 python3 -m pytest -q tests/kernels/test_sampling_kernel.py tests/engine/test_sampler_gpu.py \
  tests/engine/test_step_timing.py -p no:cacheprovider
step sampling_bench 90 python3 benchmarks/kernels/bench_sampling.py --out "$RES"
step cascade_bench 90 python3 benchmarks/kernels/bench_cascade.py --out "$RES"
step gemv_bench 150 python3 benchmarks/kernels/bench_gemv.py --models 1b --out "$RES"
step gemv_sweep 170 python3 benchmarks/kernels/bench_gemv.py --no-model --sweep --sweep-m 1 --out "$RES"
step megakernel_tests ${MKT_LIMIT:-240} python3 -m pytest -q -x tests/engine/test_megakernel_path.py tests/engine/test_fused_path.py tests/gpu/test_megakernel_gpu.py -p no:cacheprovider
step stream_bench ${STREAM_LIMIT:-300} python3 benchmarks/kernels/bench_stream.py ${STREAM_ARGS:-} --out "$RES"
step megakernel_bench 300 python3 benchmarks/kernels/bench_megakernel.py ${MK_ARGS:-} --out "$RES"
step host_step 60 python3 -m benchmarks.bench_host_step --batch 1 64 256 --steps 200 --out-dir "$RES"
# The megakernel's warp-stall profile per source line (Nsight Compute): one launch at 640 keys, its SASS
# page, and the line table of the cubin in Triton's cache that matches it.
ncu_profile() {
  local ncu=${NCU:-/usr/local/cuda/bin/ncu} rep=$WORK/mk_ncu
  "$ncu" --clock-control none --kernel-name regex:decode_megakernel --launch-skip 2 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight -f -o "$rep" \
    python3 scripts/ncu_megakernel.py --context 640 --launches 3 ${NCU_ARGS:-} || return 1
  "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$RES/ncu_megakernel_sass.csv.gz"
  "$ncu" -i "$rep.ncu-rep" --page details --csv > "$RES/ncu_megakernel_details.csv"
  local us
  us=$(python3 -c "import csv, sys
row = next(r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[12] == 'Duration')
print(float(row[14].replace(',', '')) * {'us': 1, 'ms': 1e3, 'ns': 1e-3}[row[13]])" "$RES/ncu_megakernel_details.csv")
  python3 scripts/ncu_lines.py --sass-csv "$RES/ncu_megakernel_sass.csv.gz" --duration-us "$us" --cubin \
    "$(python3 -c 'import os; print(os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache")))')"/*/_decode_megakernel.cubin \
    --per 16 --top 30 --json "$RES/ncu_megakernel_lines_$GPU.json"
}
export -f ncu_profile; export WORK RES GPU
if [[ " $STEPS " == *" ncu "* ]]; then step ncu 240 bash -c ncu_profile; fi  # only when named

if [ -n "$TRAIN_PID" ]; then
  echo "[$(elapsed)s] waiting for training"; wait "$TRAIN_PID"; tail -n 15 "$LOGS/train.log"
fi

# 4. Benchmarks, alone on the GPU (`bench`: gpu_lib.sh).
bench latency 120 latency --baseline hf --profile
bench latency_no_pruned_lm_head 90 latency --no-pruned-lm-head --name "latency_no_pruned_lm_head_$GPU"
bench latency_no_megakernel 90 latency --no-decode-megakernel --name "latency_no_megakernel_$GPU"
bench latency_unfused 90 latency --no-fused-gemv --no-decode-megakernel --name "latency_unfused_$GPU"
bench throughput 200 throughput --profile --max-model-len 4096 --baseline hf --baseline-requests 16
bench shared_prefix 150 shared-prefix --max-model-len 4096 --profile
# Model families (docs/models.md): Qwen3-0.6B's shape on both workloads beside transformers, and each family's
# bf16 logit error against transformers' own class (a Mistral-7B prompt longer than its 4,096-token window).
bench latency_qwen3 150 latency --model dummy:qwen3-0.6b --baseline hf --name "latency_qwen3-0.6b_$GPU"
bench throughput_qwen3 240 throughput --model dummy:qwen3-0.6b --max-model-len 4096 --baseline hf \
  --baseline-requests 16 --name "throughput_qwen3-0.6b_$GPU"
step family_logits ${FAM_LIMIT:-420} python3 benchmarks/family_logits.py ${FAM_ARGS:-} --out "$RES/family_logits_$GPU.json"
if [ -z "${SKIP_SERVE:-}" ] && wanted serve && python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  step serve 200 bash scripts/gpu_serve_bench.sh "$RES" || true
fi

# 5. The engine against transformers at the 1B shape (fp32 greedy with batching and preemption, bf16).
step engine_gpu_tests 200 python3 -m pytest -q -s tests/gpu -p no:cacheprovider

# 6. Everything back: one tarball in parts of at most 15 MB.
echo "[$(elapsed)s] packing"
cp -r "$LOGS" "$RES/" 2>/dev/null
[ -d "$WORK/demo" ] && cp -r "$WORK/demo" "$RES/demo"
tar czf - -C "$WORK" results | split -b 15M -d - "$OUT/session.tgz.part"
ls -la "$OUT"
echo "[$(elapsed)s] done"

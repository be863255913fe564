#!/usr/bin/env bash
# The device measurements that decide what was built and not yet timed, and the H200 figures of what was
# decided on the H100 (docs/perf.md names each, with the default it would change). Steps run in this order
# while BUDGET lasts; pick a group per device call (≤ 10 min each) with STEPS. Next, in this order:
#
#   STEPS="int8_rows_tests startup_bytecode startup_8b_bytecode startup" ... (H200)  # §12: ≤ 4 s where it is set
#   STEPS="sizes sizes_qwen3" ... (on an H200, two calls)                   # §1e: the issue's table, every size
#   STEPS="pdl_bench" ...                                                   # §1e: 3B and 8B with the gemv rule
#   STEPS=sizes_qwen3 ...                                                   # §1e: Qwen3-0.6B / 1.7B / 8B
#   STEPS="mk_tests mk_kv_align" ...                                        # §1e on the H200
#   STEPS=attn_sweep_64 ...                                                 # §3a: d 64's Hopper options
#   STEPS="decode_sweep_fp8 fp8_cost" ...                                   # §9 on the H200
#   STEPS="top_p_only serve_top_p" ...                                      # §5, §7
#   STEPS=structured_prepare ...;  STEPS="rows_bench_8b rows_bench_fp8" ... # §10, §1e
#   STEPS="decode_sweep cascade_stages prefix_stream_test tp_default tp_prefix_stream" ...  # §4 on the H200
# Done on the H100 (187ce24): layer_ops_tests, sizes_ours, pdl_tests, decode_bench, b8_profile_1b, gemv_sweep_m*;
# (da52f79, e9ebac6): startup, startup_bytecode, startup_8b_bytecode, gemv_tests, gemv_bench, pdl_bench_1b, sizes_qwen3.
# Done on the H100 (710c474): sizes, attn_sweep_128, train_compare, prefill_sweep, decode_sweep_fp8,
# fp8_cost, mk_tests, radix_kernel. On the H200 (39e1da9): sizes, pdl_tests, pdl_bench, startup, startup_8b,
# prefill_tests, attn_bench, fp8_tests, the prefill bench.
#
# Name the commit in the run command (`TINYVLLM_GIT_COMMIT=<local git rev-parse --short HEAD> bash ...`): the
# device's copy of the tree may carry a stale .git, and result files record the commit they ran.
# Carry .whl in every call (the device image lacks msgspec, which the CLI imports; fastapi etc. for serve;
# xgrammar for structured outputs): `bash scripts/device_wheels.sh` fills it.
# Results and logs come back under $OUT as session.tgz.part* (gpu_session.sh's packing).
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_lib.sh
export BUDGET=${BUDGET:-560}
MARK=$WORK/start.mark
touch "$MARK"

step checkpoint 120 python3 -c "from tinyvllm.models.checkpoint import resolve_model; print(resolve_model('dummy:llama-3.2-1b'))"

# 0. Start-up (§12) with the collector paused and Triton's key stored: the 1B warm target is 4 s.
step startup 300 $CLI bench startup --model dummy:llama-3.2-1b --warm-runs 2 --out-dir "$RES"
step startup_8b 300 $CLI bench startup --model dummy:llama-3.1-8b --warm-runs 1 --out-dir "$RES"
# The same with every imported package's bytecode compiled ahead, as `pip install` leaves it: the image
# ships torch without bytecode and sets PYTHONDONTWRITEBYTECODE (§12).
step startup_bytecode 300 $CLI bench startup --model dummy:llama-3.2-1b --warm-runs 2 --compile-bytecode /tmp/pyc \
  --name "startup_bytecode_$GPU" --out-dir "$RES"
step startup_8b_bytecode 300 $CLI bench startup --model dummy:llama-3.1-8b --warm-runs 1 --compile-bytecode /tmp/pyc \
  --name "startup_llama-3.1-8b_bytecode_$GPU" --out-dir "$RES"

# 1. The rows megakernel (§1e): correctness over every program, then against the layer loop, then in the engine.
step rows_tests 240 python3 -m pytest -q -x tests/gpu/test_rows_megakernel_gpu.py -p no:cacheprovider \
  -k "((default or aligned) and (llama-3.2-1b or qwen3)) or graph"
# The default (phase B's K/V tiles aligned, 5 key stages) against the unaligned 3-stage loop, 7 stages, finer
# splits and 8 warps (0-88 bytes of register spills a thread against 4 warps' 56-808; Triton 3.6, sm_90):
step rows_trace 300 python3 benchmarks/kernels/bench_rows_megakernel.py --batches 1 8 16 --no-fp32 --trace \
  --variant kv_align=0,kv_stages=3 --variant kv_stages=7 --variant attn_splits=4 --variant num_warps=8 --out "$RES"
step rows_bench 540 python3 benchmarks/kernels/bench_rows_megakernel.py --out "$RES"
step rows_engine_test 200 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k rows_megakernel -p no:cacheprovider
step rows_bench_8b 300 python3 benchmarks/kernels/bench_rows_megakernel.py --preset llama-3.1-8b --no-fp32 --out "$RES"
# FP8 weights: the rows kernel's tensor-core products against the batch-1 megakernel's reduction at one row too
step rows_bench_fp8 300 python3 benchmarks/kernels/bench_rows_megakernel.py --fp8 --batches 1 2 8 --no-fp32 --out "$RES"
# The batch-1 megakernel (§1b) with phase B's K/V tiles as 16-byte vector loads (MegakernelConfig.kv_align, on
# by default since the H100 run of §1e) against the unaligned tiles, on the H200; Qwen3-0.6B with phase traces.
mk_kv_align() {
  python3 benchmarks/kernels/bench_megakernel.py --preset qwen3-0.6b --contexts 640 --no-fp32 --variant kv_align=0 \
    --out "$RES/mk_qwen3-0.6b" || echo "FAILED qwen3-0.6b"
  for p in llama-3.2-1b llama-3.1-8b llama-3.2-3b qwen3-4b; do
    python3 benchmarks/kernels/bench_megakernel.py --preset "$p" --contexts 640 --no-traces --no-fp32 \
      --variant kv_align=0 --out "$RES/mk_$p" || echo "FAILED $p"
  done
}
export -f mk_kv_align
step mk_tests 400 python3 -m pytest -q -x tests/gpu/test_megakernel_gpu.py -p no:cacheprovider -k "kv_align or family or fp8"
step mk_kv_align 400 bash -c mk_kv_align

# RoPE with the cache write (§6) against the two kernels at real shapes, and the model paths that call it.
step layer_ops_tests 300 python3 -m pytest -q tests/kernels/test_gpu_shapes.py::test_layer_ops_real_shapes \
  tests/kernels/test_gpu_shapes.py::test_decode_real_shapes tests/gpu/test_engine_gpu.py -p no:cacheprovider
# The issue's table: batch 1 and 8 for every preset beside transformers, today's paths then the rows kernel.
step sizes 560 python3 -m benchmarks.sizes --baseline hf --presets llama-3.2-1b llama-3.2-3b qwen3-4b llama-3.1-8b \
  --out-dir "$RES"
# The same four presets without transformers (a rerun to time a change against sizes_<gpu>.json; ~2 min less).
step sizes_ours 400 python3 -m benchmarks.sizes --presets llama-3.2-1b llama-3.2-3b qwen3-4b llama-3.1-8b \
  --name "sizes_ours_$GPU" --out-dir "$RES"
step sizes_qwen3 560 python3 -m benchmarks.sizes --baseline hf --presets qwen3-0.6b qwen3-1.7b qwen3-8b \
  --name "sizes_qwen3_$(python3 -c 'from tinyvllm.bench.report import device_tag; print(device_tag())')" --out-dir "$RES"
# Programmatic dependent launch on the fused path (§1e, kernels/pdl.py): same bits as ordinary launches, then
# steps of 2-16 rows against the layer loop, with L2 prefetch budgets of 0-48 MB; engine figures after.
step pdl_tests 300 python3 -m pytest -q tests/gpu/test_pdl_gpu.py -p no:cacheprovider
# The matrix-vector kernel's defaults at 2-16 rows (§1e) at real shapes, then the fused path at 1B with them.
# The int8 copy of the LM head in one kernel (§12) against its torch reference at the real LM heads.
step int8_rows_tests 200 python3 -m pytest -q tests/kernels/test_gpu_shapes.py -k int8 tests/kernels/test_int8_rows.py \
  tests/kernels/test_lm_head_bounds.py -p no:cacheprovider
step gemv_tests 300 python3 -m pytest -q -x tests/kernels/test_gpu_shapes.py -k gemv -p no:cacheprovider
step gemv_bench 200 python3 benchmarks/kernels/bench_gemv.py --batches 1 2 8 16 --models 1b 8b --no-model --out "$RES"
step pdl_bench_1b 300 python3 benchmarks/kernels/bench_pdl.py --preset llama-3.2-1b --out "$RES"
pdl_bench() {
  for p in llama-3.2-1b llama-3.2-3b llama-3.1-8b; do
    python3 benchmarks/kernels/bench_pdl.py --preset "$p" --out "$RES" || echo "FAILED $p"
  done
}
export -f pdl_bench
step pdl_bench 480 bash -c pdl_bench
bench pdl_latency_b8 200 latency --model dummy:llama-3.2-1b --batch-size 8 --fused-max-tokens 16 --pdl \
  --name "latency_b8_pdl_$GPU"
# The matrix-vector kernel's configs at 2-16 rows (§1e: 0.83x cuBLAS at M = 8 with the untuned default, the
# fused path's gap to the layer loop); one M a call, the 1B shapes the fused path multiplies.
for m in 2 8 16; do
  step "gemv_sweep_m$m" 560 python3 benchmarks/kernels/bench_gemv.py --sweep --sweep-m $m --batches $m --models 1b \
    --sweep-proj qkv o down gate_up --no-model --out "$RES/gemv_m$m"
done
# Where a batch-8 step of the layer loop goes (kernels by class, the device's gaps between them): §1e's 0.75.
bench b8_profile_1b 200 latency --model dummy:llama-3.2-1b --batch-size 8 --profile --name "latency_b8_profile_$GPU"
bench b8_profile_3b 200 latency --model dummy:llama-3.2-3b --batch-size 8 --profile \
  --name "latency_llama-3.2-3b_b8_profile_$GPU"
step sizes_rows 560 python3 -m benchmarks.sizes --batches 8 --engine-args "--rows-megakernel" --out-dir "$RES/rows"

# 2. The top-k radix select (§5): same ids as the search on the H200, its kernel time, then the engine A/B.
step radix_tests 240 python3 -m pytest -q tests/kernels/test_top_p_sampling.py -k "radix or precheck" -p no:cacheprovider
step radix_kernel 200 python3 benchmarks/kernels/bench_top_p_sampling.py --batches 1 64 256 --dtypes bfloat16 --out "$RES"
bench top_p_plain 200 throughput --max-model-len 4096 --name "throughput_top_p_plain_$GPU"
bench top_p_radix 200 throughput --max-model-len 4096 --top-p 0.9 --top-k 50 --name "throughput_top_p_$GPU"
step top_p_search 200 python3 scripts/with_search.py bench throughput --max-model-len 4096 --top-p 0.9 --top-k 50 \
  --out-dir "$RES" --name "throughput_top_p_search_$GPU"

# 3. FP8 with the activation quantization fused into RMSNorm and SwiGLU (§9).
step fp8_cost 300 python3 -m benchmarks.determinism --part cost --variants default fp8_both --iters 2 --out-dir "$RES"
step fp8_tests 200 python3 -m pytest -q tests/kernels/test_fp8_fused_quant.py tests/quantization/test_fp8_numerics.py \
  tests/engine/test_fp8_layer_loop.py -p no:cacheprovider
step fp8_quant_bench 150 python3 benchmarks/kernels/bench_fp8_quant.py --rows 8 32 64 128 256 --out "$RES"

# 4. The attention backward's Hopper options (§3a: descriptor loads, warp specialisation) and the training
# forward's tiles, swept with today's tiles; a call per head dim (~115 candidates each).
step attn_sweep_128 560 python3 benchmarks/kernels/bench_attention_backward.py --sweep --head-dims 128 --out "$RES"
step attn_sweep_64 560 python3 benchmarks/kernels/bench_attention_backward.py --sweep --head-dims 64 --out "$RES/d64"
# The prefill's 5-stage long-chunk configs at real shapes (mixed chunks up to 8k tokens, windows, FP8 caches).
step prefill_tests 300 python3 -m pytest -q tests/kernels/test_gpu_shapes.py tests/kernels/test_fp8_kv_cache.py \
  -k "prefill or window or fp8" -p no:cacheprovider
# The backward at the tables (d 128's dK/dV by TMA with a warp-specialised loop): the GPU tests first
# (gradients against float64 with GQA and uneven lengths, run-to-run identity), then beside flash and cuDNN.
step attn_bench 560 bash -c "python3 -m pytest -q -x tests/gpu/test_flash_backward_gpu.py -p no:cacheprovider \
  && python3 benchmarks/kernels/bench_attention_backward.py --out $RES"

# The demo model trained through our attention against SDPA, same seed, and SDPA from another seed (§3a).
step train_compare 500 python3 -m benchmarks.bench_training --train-args "--epochs 8 --max-minutes 2" --out-dir "$RES"

# The paged prefill's candidates (§3), five-stage pipelines among them, at pages of 16 and 256 keys.
step prefill_sweep 560 python3 benchmarks/kernels/bench_prefill_attention.py --sweep --no-flex --out "$RES"
step prefill_sweep_p256 560 python3 benchmarks/kernels/bench_prefill_attention.py --sweep --no-flex --block-sizes 256 16 \
  --out "$RES/p256"

# 5. Decode attention's candidates, 3 against 5 stages (the first depth whose loop prefetches, §3/§4).
# The workload beside SDPA's backends, with the split and merge kernels as PDL dependents too (§4: the issue's
# "at or above cuDNN's fraction" at 1 x 32k and 16 x 2k, missed by the two launches' ramp).
step decode_bench 300 python3 benchmarks/kernels/bench_decode_attention.py --no-flex --out "$RES"
step decode_sweep 400 python3 benchmarks/kernels/bench_decode_attention.py --sweep --no-flex --out "$RES/sweep"
# The same candidates over an FP8 cache (#36: 0.68 / 0.64 of the copy bandwidth today, target 0.85): FP8_CONFIG.
step decode_sweep_fp8 500 python3 benchmarks/kernels/bench_decode_attention.py --sweep --fp8 --no-flex --quick \
  --out "$RES/sweep_fp8"
step cascade_stages 150 python3 benchmarks/kernels/bench_cascade.py --out "$RES"
# The cascade's prefix kernel on a stream of its own beside the splits (§4, DecodeConfig.prefix_stream):
# bitwise the one-stream output, in a captured graph too; then the engine with and without it.
step prefix_stream_test 150 python3 -m pytest -q tests/kernels/test_gpu_shapes.py -k prefix_stream -p no:cacheprovider
bench tp_default 200 throughput --max-model-len 4096 --name "throughput_default_$GPU"
step tp_prefix_stream 200 python3 scripts/with_decode_config.py prefix_stream=1 -- bench throughput \
  --max-model-len 4096 --out-dir "$RES" --name "throughput_prefix_stream_$GPU"

# 6. Serving at rate inf with top_p 0.9 against the offline figure with it (#40; needs .whl carried):
# the API process's CPU per token fell by half unpaced on the development CPU (§7).
bench top_p_only 200 throughput --max-model-len 4096 --top-p 0.9 --name "throughput_top_p_only_$GPU"
step serve_top_p 420 env BENCH_ARGS="--top-p 0.9" bash scripts/gpu_serve_bench.sh "$RES/serve_top_p09"

# 7. Structured outputs with the next step's inputs packed in the constrained step's launch (§10).
step structured_prepare 400 python3 -m benchmarks.structured --repeats 3 --prepare-in-launch \
  --name "structured_prepare_$GPU" --out-dir "$RES"

echo "[$(elapsed)s] packing"
find benchmarks/results -newer "$MARK" -type f -exec cp {} "$RES/" \; 2>/dev/null
cp -r "$LOGS" "$RES/" 2>/dev/null
tar czf - -C "$WORK" results | split -b 15M -d - "$OUT/session.tgz.part"
ls -la "$OUT"
echo "[$(elapsed)s] done"

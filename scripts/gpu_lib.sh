#!/usr/bin/env bash
# Shared by the GPU session scripts (gpu_session.sh, gpu_pending.sh), sourced from the repository root:
# the environment, the results and logs directories, and `step` / `bench`, which run one timed step each,
# never stopping the script on a failure.
set -u
export PYTHONUNBUFFERED=1 TINYVLLM_CACHE=/tmp/tinyvllm-cache TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}
WORK=/tmp/gpu-session
RES=$WORK/results
LOGS=$WORK/logs
mkdir -p "$OUT" "$RES" "$LOGS"
export RES  # the steps that run an exported shell function (bash -c) write there too
T0=$(date +%s)
BUDGET=${BUDGET:-480}  # seconds for the whole script; later steps are skipped when it runs out
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
STEPS=${STEPS:-all}
wanted() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if ! wanted "$name" && [ "$name" != checkpoint ]; then return 98; fi
  local l; l=$(left)
  if (( l < 20 )); then echo "[$(elapsed)s] SKIP $name (budget)"; return 99; fi
  (( limit > l )) && limit=$l
  echo "[$(elapsed)s] >>> $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "[$(elapsed)s] <<< $name rc=$rc"
  tail -n 25 "$LOGS/$name.log"
  return $rc
}
CLI="python3 -m tinyvllm.entrypoints.cli"  # a command, not a shell function: `timeout` runs it
# The GPU's short name in result files (<bench>_<gpu>.json, e.g. latency_h200.json), as the benches name them.
GPU=$(python3 -c "from tinyvllm.bench.report import device_tag; print(device_tag())" 2>/dev/null || echo gpu)
export GPU

nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

# Server wheels (fastapi, uvicorn, pydantic) travel in .whl when carried.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi


# A CLI bench as a step; if the CUDA-graph/async path fails, retry eagerly and say so.
bench() {  # bench NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" $CLI bench "$@" --out-dir "$RES"
  case $? in
    0|98|99|124|137) ;;  # done, not asked for, skipped, or out of time: a retry would not finish either
    *) step "${name}_eager" "$limit" $CLI bench "$@" --out-dir "$RES" --name "${name}_eager_$GPU" \
         --enforce-eager --no-async-scheduling ;;
  esac
}

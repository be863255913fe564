#!/usr/bin/env bash
# The `serving` workload on the GPU: start `tinyvllm serve` on the 1B-shape checkpoint (engine in its own
# process, the default), then `tinyvllm bench serve` at request rates 4, 16, 64 per second and inf (all
# requests at t = 0); JSON into $1 as serving_<label>_<gpu>.json (serving_rate64_h200.json, ...).
# COMPARE_THREAD=1 then repeats rates 64 and inf against a server whose engine runs on a thread of the
# server process (--engine-in-thread), for an A/B on the same machine (one more server start, ~1 min
# more). A smoke test on a CPU:
#   MODEL=dummy:tiny SERVE_ARGS="--device cpu --dtype float32 --max-model-len 512" \
#   BENCH_ARGS="--input-len 5:20 --output-len 4:16 --max-token-id 500" bash scripts/gpu_serve_bench.sh /tmp/r
set -u
RES=${1:-benchmarks/results}
PORT=${PORT:-8011}
MODEL=${MODEL:-dummy:llama-3.2-1b}
SERVE_ARGS=${SERVE_ARGS:---dtype bfloat16 --max-model-len 4096}
BENCH_ARGS=${BENCH_ARGS:-}
cli() { python3 -m tinyvllm.entrypoints.cli "$@"; }
GPU=${GPU:-$(python3 -c "from tinyvllm.bench.report import device_tag; print(device_tag())" 2>/dev/null || echo gpu)}
SERVER=

start_server() {  # start_server LOG EXTRA_FLAGS...
  local log=$1; shift
  # Not through `cli`: a backgrounded function runs in a subshell, and $! would name the subshell
  # (which ignores SIGINT) instead of the server. shellcheck disable=SC2086  # SERVE_ARGS: several flags
  python3 -m tinyvllm.entrypoints.cli serve --model "$MODEL" $SERVE_ARGS --port "$PORT" \
    --uvicorn-log-level warning "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 180); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
      2>/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { echo "server exited during start-up"; tail -n 20 "$log"; return 1; }
    sleep 1
  done
  echo "server did not answer /health within 180 s"; return 1
}

stop_server() {  # SIGINT, as Ctrl-C would; the server drains, stops its engine process, exits 0
  local log=$1 children
  children=$(ps -o pid= --ppid "$SERVER" 2>/dev/null | tr '\n' ' ')
  kill -INT "$SERVER"; wait "$SERVER"
  echo "server exit status: $?"
  sleep 2  # multiprocessing's resource tracker exits just after the server
  for pid in $children; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "WARNING: child process $pid outlived the server: $(ps -o cmd= --pid "$pid" | cut -c1-120)"
    fi
  done
  tail -n 5 "$log"
}

bench() {  # bench RATE NUM_PROMPTS LABEL
  # shellcheck disable=SC2086
  cli bench serve --base-url "http://127.0.0.1:$PORT" --request-rate "$1" --num-prompts "$2" \
    --result-dir "$RES" --label "$3" --result-file "$RES/serving_$3_$GPU.json" $BENCH_ARGS
}

rc=0
if start_server /tmp/serve.log; then
  bench 4 64 rate4 || rc=1
  bench 16 128 rate16 || rc=1
  bench 64 256 rate64 || rc=1
  bench inf 256 rateinf || rc=1
  stop_server /tmp/serve.log
else
  rc=1
fi

if [ -n "${COMPARE_THREAD:-}" ]; then
  if start_server /tmp/serve_thread.log --engine-in-thread; then
    bench 64 256 thread_rate64 || rc=1
    bench inf 256 thread_rateinf || rc=1
    stop_server /tmp/serve_thread.log
  else
    rc=1
  fi
fi
exit $rc

#!/usr/bin/env bash
# The `serving` workload on the GPU: start `tinyvllm serve` on the 1B-shape checkpoint, then
# `tinyvllm bench serve` at request rates 4, 16 and 64 per second; JSON into $1.
set -u
RES=${1:-benchmarks/results}
PORT=${PORT:-8011}
cli() { python3 -m tinyvllm.entrypoints.cli "$@"; }
cli serve --model dummy:llama-3.2-1b --dtype bfloat16 --max-model-len 4096 --port "$PORT" \
  --uvicorn-log-level warning > /tmp/serve.log 2>&1 &
SERVER=$!
for _ in $(seq 1 120); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
    2>/dev/null && break
  sleep 1
done
rc=0
cli bench serve --base-url "http://127.0.0.1:$PORT" --request-rate 4 --num-prompts 64 --result-dir "$RES" --label rate4 || rc=1
cli bench serve --base-url "http://127.0.0.1:$PORT" --request-rate 16 --num-prompts 128 --result-dir "$RES" --label rate16 || rc=1
cli bench serve --base-url "http://127.0.0.1:$PORT" --request-rate 64 --num-prompts 256 --result-dir "$RES" --label rate64 || rc=1
kill -INT "$SERVER"; wait "$SERVER"
echo "server exit status: $?"
tail -n 5 /tmp/serve.log
exit $rc

#!/usr/bin/env bash
# Lesson 14's engine figures, synchronous vs async scheduling (EngineConfig::async_scheduling), in one call so that
# the two are measured on the same GPU minutes apart: `bench throughput` twice each way, alternating (the spread
# between the two runs of one mode is the noise to compare the difference with), then `serve` + `bench serve` at
# concurrency 1 (TPOT, TTFT) and 32, each way. gpu_pass.sh runs it as its stage "engine".
#
#   bash tests/engine_compare.sh MODEL_DIR [TINY_VLLM]      (default: build-gpu/bin/tiny-vllm)
#   DEVICE=cpu THROUGHPUT_ARGS="--num-requests 8 --min-len 8 --max-len 32" SERVE_SCALE=0 \
#     bash tests/engine_compare.sh weights/tiny-llama3 build/bin/tiny-vllm      # a smoke run of the script itself
set -uo pipefail
model=${1:?usage: engine_compare.sh MODEL_DIR [TINY_VLLM]}
tvllm=${2:-build-gpu/bin/tiny-vllm}
DEVICE=${DEVICE:-cuda}
THROUGHPUT_ARGS=${THROUGHPUT_ARGS:-}   # default: the course's workload (256 requests, U[100, 1024])
SERVE_SCALE=${SERVE_SCALE:-1}          # 0: 4 requests per server run, 8 tokens each (smoke)
status=0

for round in 1 2; do
  for mode in --no-async-scheduling --async-scheduling; do
    echo "== bench throughput $mode, round $round"
    "$tvllm" bench throughput --model "$model" --device "$DEVICE" $THROUGHPUT_ARGS $mode 2>/dev/null | tail -16 ||
      status=1
  done
done

# serve_bench FLAGS CONCURRENCY REQUESTS: a server on a free port, the load generator against it, then SIGINT.
serve_bench() {
  local flags=$1 concurrency=$2 requests=$3 log url pid
  log=$(mktemp)
  "$tvllm" serve --model "$model" --device "$DEVICE" --port 0 --quiet $flags >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do grep -q '^listening on' "$log" && break; sleep 0.1; done
  url=$(sed -n 's/^listening on \(http:[^ ]*\) .*/\1/p' "$log")
  if [ -z "$url" ]; then
    echo "serve did not start:"; cat "$log"; kill "$pid" 2>/dev/null; status=1; return
  fi
  local tokens=128
  [ "$SERVE_SCALE" = 0 ] && requests=4 tokens=8
  echo "== bench serve $flags, concurrency $concurrency"
  "$tvllm" bench serve --url "$url" --concurrency "$concurrency" --num-requests "$requests" --max-tokens "$tokens" \
    --prompt-len 128 || status=1
  kill -INT "$pid"
  wait "$pid" || status=1
  rm -f "$log"
}
for mode in --no-async-scheduling --async-scheduling; do
  serve_bench "$mode" 1 48
  serve_bench "$mode" 32 256
done
exit $status

#!/usr/bin/env bash
# The whole server at a real shape on random weights, measured by its client benchmark (CUDA only).
#
# Usage (repo root): bash lab/gpu_serve_bench.sh OUT_DIR [PRESET] [steps]
#   steps (comma-separated, default ttft,multiturn):
#     ttft       8K-token prompts at concurrency 1 (TTFT p50/p90/p99, the first request included) at the default
#                --prefill-chunk 1024 and in one chunk (--prefill-chunk 8192)
#     multiturn  8 agent conversations x 20 turns on a 20,000-token shared system prompt (cached share, TTFT); the KV
#                pool holds all eight conversations (--kv-capacity follows --max-context unless given)
#     decode     batch-1 and 8-stream decode through the server (TPOT, output throughput)
# Each server's log and each benchmark's JSON land in OUT_DIR; a summary table is printed last.
set -u
OUT=${1:?OUT_DIR}
PRESET=${2:-qwen3.6-27b}
STEPS=${3:-ttft,multiturn}
mkdir -p "$OUT"
PORT=18123
URL=http://127.0.0.1:$PORT

serve() {  # NAME [serve options]: start a server, wait until /health answers (or it exits)
  local name=$1; shift
  python3 -c "from ninfer.cli import main; main()" serve --synthetic "$PRESET" --host 127.0.0.1 --port $PORT "$@" >"$OUT/server-$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" 2>/dev/null; then grep -E "warmed up|context cost" "$OUT/server-$name.log"; return 0; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server $name exited"; tail -20 "$OUT/server-$name.log"; return 1; fi
    sleep 1
  done
  echo "server $name not ready"; return 1
}

stop() { kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; }

bench() {  # NAME [bench serve options]
  local name=$1; shift
  python3 -c "from ninfer.cli import main; main()" bench serve --base-url $URL --json "$@" >"$OUT/bench-$name.json" 2>"$OUT/bench-$name.err" \
    || { echo "bench $name failed"; cat "$OUT/bench-$name.err"; }
}

case ",$STEPS," in *,ttft,*)
  for chunk in 1024 8192; do
    serve "chunk$chunk" --max-concurrency 1 --max-context 16384 --prefill-chunk $chunk || continue
    bench "ttft-chunk$chunk" --endpoint chat --dataset random --input-len 8192 --output-len 16 --num-requests 6 \
      --concurrency 1
    stop
  done;;
esac

case ",$STEPS," in *,multiturn,*)
  if serve multiturn --max-concurrency 8 --max-context 40960 --kv-capacity 524288; then
    bench multiturn --endpoint chat --dataset multiturn --turns 20 --system-prompt-len 20000 --input-len 200 \
      --output-len 64 --num-requests 8 --concurrency 8
    stop
  fi;;
esac

case ",$STEPS," in *,decode,*)
  if serve decode --max-concurrency 8 --max-context 4096; then
    bench decode-1 --endpoint chat --dataset random --input-len 512 --output-len 256 --num-requests 3 --concurrency 1
    bench decode-8 --endpoint chat --dataset random --input-len 512 --output-len 256 --num-requests 16 --concurrency 8
    stop
  fi;;
esac

python3 lab/serve_bench_summary.py "$OUT"

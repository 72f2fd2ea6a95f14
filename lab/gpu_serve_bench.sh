#!/usr/bin/env bash
# The whole server at a real shape on random weights, measured by its client benchmark (CUDA only).
#
# Usage (repo root): bash lab/gpu_serve_bench.sh OUT_DIR [PRESET] [steps]
#   steps (comma-separated, default ttft,multiturn; TTFT_CHUNKS="1024 8192" picks the ttft step's chunk sizes):
#     ttft       8K-token prompts at concurrency 1 (TTFT p50/p90/p99, the first request included) at the default
#                --prefill-chunk 1024 and in one chunk (--prefill-chunk 8192)
#     multiturn  8 agent conversations x 20 turns on a 20,000-token shared system prompt (cached share, TTFT); the KV
#                pool holds all eight conversations (--kv-capacity follows --max-context unless given)
#     decode     batch-1 and 8-stream decode through the server (TPOT, output throughput; the KV pool holds 8 rows)
#     interleave 4 decoding streams alone, then again while a 32K-token prompt prefills (their ITL p50/p99)
#     long       one server at --max-context 262144: TTFT, prefill rate and decode at 8K/32K/128K/240K prompts
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
  for chunk in ${TTFT_CHUNKS:-1024 8192}; do
    serve "chunk$chunk" --max-concurrency 1 --max-context 16384 --prefill-chunk $chunk \
      --request-log-jsonl "$OUT/ttft-chunk$chunk.jsonl" || continue
    bench "ttft-chunk$chunk" --endpoint chat --dataset random --input-len 8192 --output-len 16 --num-requests 6 \
      --concurrency 1
    stop
    python3 lab/reuse_report.py "$OUT/ttft-chunk$chunk.jsonl" --timings > "$OUT/ttft-chunk$chunk-timings.txt"
  done;;
esac

case ",$STEPS," in *,multiturn,*)
  if serve multiturn --max-concurrency 8 --max-context 40960 --kv-capacity 524288 \
      --request-log-jsonl "$OUT/multiturn.jsonl"; then
    bench multiturn --endpoint chat --dataset multiturn --turns 20 --system-prompt-len 20000 --input-len 200 \
      --output-len 64 --num-requests 8 --concurrency 8
    stop
    python3 lab/reuse_report.py "$OUT/multiturn.jsonl" > "$OUT/multiturn-reuse.txt"
  fi;;
esac

case ",$STEPS," in *,decode,*)
  if serve decode --max-concurrency 8 --max-context 4096 --kv-capacity 32768; then
    bench decode-1 --endpoint chat --dataset random --input-len 512 --output-len 256 --num-requests 3 --concurrency 1
    bench decode-8 --endpoint chat --dataset random --input-len 512 --output-len 256 --num-requests 16 --concurrency 8
    stop
  fi;;
esac

case ",$STEPS," in *,interleave,*)
  if serve interleave --max-concurrency 8 --max-context 40960 --kv-capacity 65536; then
    bench streams-alone --endpoint chat --dataset random --input-len 512 --output-len 512 --num-requests 4 --concurrency 4
    bench streams-during-prefill --endpoint chat --dataset random --input-len 512 --output-len 512 --num-requests 4 \
      --concurrency 4 &
    STREAMS=$!
    sleep 3
    bench long-prefill --endpoint chat --dataset random --input-len 32768 --output-len 4 --num-requests 1 --concurrency 1
    wait $STREAMS
    stop
  fi;;
esac

case ",$STEPS," in *,long,*)
  if serve long --max-concurrency 1 --max-context 262144 --kv-capacity 262144; then
    for len in 8192 32768 131072 240000; do
      bench "long-$len" --endpoint chat --dataset random --input-len $len --output-len 128 --num-requests 1 --concurrency 1
    done
    stop
  fi;;
esac

python3 lab/serve_bench_summary.py "$OUT"

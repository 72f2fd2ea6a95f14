"""The summary table of ``lab/gpu_serve_bench.sh``: one line per benchmark JSON in OUT_DIR (and, for multi-turn
runs, the cached share and TTFT spread of turns 2 and later)."""

import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("bench-*.json")):
    try:
        r = json.loads(path.read_text())
    except ValueError:
        print(path.name, "no result"); continue
    ms = lambda metric: "/".join(f"{r.get(f'{s}_{metric}_ms') or 0:.0f}" for s in ("p50", "p90", "p99"))
    print(f"{path.stem:22s} ok {r['completed']}/{r['total_requests']}  TTFT p50/90/99 {ms('ttft')} ms  "
          f"TPOT p50 {r.get('p50_tpot_ms') or 0:.2f} ms  ITL p50/90/99 {ms('itl')} ms  "
          f"out {r['output_throughput']:.1f} tok/s  cached {r['cached_token_ratio']:.3f}")
    later = [q for q in r["requests"] if q["ok"] and q["turn"] >= 2]
    if later:
        prompt, cached = sum(q["prompt_tokens"] for q in later), sum(q["cached_tokens"] for q in later)
        ttft = sorted(q["ttft_ms"] for q in later)
        p50, p90 = ttft[len(ttft) // 2], ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
        print(f"{'':22s} turns >= 2: cached {cached}/{prompt} = {cached / max(prompt, 1):.3f}, "
              f"TTFT p50 {p50:.0f} ms, p90 {p90:.0f} ms ({p90 / max(p50, 1e-9):.2f}x)")

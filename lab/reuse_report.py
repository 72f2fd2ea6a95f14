"""Why requests of a ``--request-log-jsonl`` file reused what they did: one line per request that reused less than
90 % of its prompt (hit, path, reuse limit, materialization), then the summed context-cache counters; with
``--timings`` also every request's ``timings_seconds`` in milliseconds.

Usage: ``python lab/reuse_report.py FILE.jsonl [--timings]``.
"""

import collections
import json
import sys

counters: collections.Counter = collections.Counter()
done = 0
for line in open(sys.argv[1]):
    try:
        record = json.loads(line)
    except ValueError:
        continue
    kind = record.get("event")
    if kind == "request_done":
        done += 1
        result = record.get("result") or {}
        if "--timings" in sys.argv:
            timings = record.get("timings_seconds") or {}
            print(f"#{done} " + " ".join(f"{key} {value * 1e3:.1f}" for key, value in timings.items()
                                         if isinstance(value, (int, float))))
        prompt, hit = result.get("prompt_tokens") or 0, result.get("prefix_cache_hit_tokens") or 0
        if prompt and hit < 0.9 * prompt:
            m = record.get("materialization") or result.get("materialization") or {}
            print(f"#{done} prompt {prompt} hit {hit} path {result.get('prefix_reuse_path')} "
                  f"limit {result.get('reuse_limit')} units {m.get('degradation_units')} "
                  f"fallback {m.get('maximal_root_fallback')}")
    elif kind == "throughput":
        cache = (record.get("context_cache") or {}).get("counters") or {}
        for key, value in cache.items():
            if isinstance(value, (int, float)):
                counters[key] += value
            elif isinstance(value, dict):
                for sub, number in value.items():
                    if isinstance(number, (int, float)):
                        counters[f"{key}.{sub}"] += number
print(f"{done} requests; context-cache counters summed over throughput records:")
for key, value in sorted(counters.items()):
    if value:
        print(f"  {key} {value}")

"""Multi-turn prefix reuse through the real server on CUDA: cached tokens per turn, and the same greedy answers
with ``--no-prefix-reuse``.

Usage (CUDA machine, repo root, .whl carried): ``python lab/gpu_multiturn.py OUT_DIR [TURNS]``. Builds a tiny Qwen
artifact, serves it twice (reuse on and off) on 127.0.0.1 and runs one thinking-on Chat conversation on each.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(artifact: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-c", "from ninfer.cli import main; main()", "serve", str(artifact),
               "--host", "127.0.0.1", "--port", str(port), "--default-max-tokens", "48", *args]
    process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def conversation(base: str, turns: int) -> list[dict]:
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    messages = [{"role": "system", "content": "You are terse."}]
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Question {turn}: say something about the number {turn}."})
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 48}
        started = time.perf_counter()
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=300).json()
        elapsed = time.perf_counter() - started
        message = reply["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message.get("content") or ""})
        usage = reply["usage"]
        rows.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                     "seconds": round(elapsed, 3), "answer": message.get("content"),
                     "reasoning": message.get("reasoning_content")})
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    turns = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    out.mkdir(parents=True, exist_ok=True)
    artifact = out / "tiny.ninfer"
    subprocess.run([sys.executable, "-c", "from ninfer.cli import main; main()", "make-tiny", str(artifact)],
                   check=True)
    results = {}
    for name, args in (("reuse", ()), ("root", ("--no-prefix-reuse",))):
        process, base = serve(artifact, out / f"serve_{name}.log", *args)
        try:
            results[name] = conversation(base, turns)
        finally:
            process.terminate()
            process.wait(30)
    (out / "multiturn.json").write_text(json.dumps(results, indent=1))
    same = [(a["answer"], a["reasoning"]) for a in results["reuse"]] == [
        (b["answer"], b["reasoning"]) for b in results["root"]]
    print("turn | prompt | cached (reuse) | cached (root) | s (reuse) | s (root)")
    for index, (a, b) in enumerate(zip(results["reuse"], results["root"]), 1):
        print(f"{index:4} | {a['prompt']:6} | {a['cached']:14} | {b['cached']:13} | {a['seconds']:9} | {b['seconds']}")
    print("greedy outputs identical with and without reuse:", same)


if __name__ == "__main__":
    main()

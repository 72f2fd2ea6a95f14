"""``ninfer bench --synthetic NAME``: ninfer vs. transformers vs. the memory-bandwidth roofline on random weights.

The model of a named real configuration (``ninfer.plugins.qwen3_5.model.presets``) is built directly on the device in bf16.
With ``compare_transformers`` transformers' own ``Qwen3_5(Moe)ForCausalLM`` is built first and ninfer borrows its
tensors (its fused projections become the storage both use), so both engines run the same weights with one copy.
Measured in one run: a device-to-device copy bandwidth; ninfer decode (batch 1 and aggregate at each concurrency,
each step a full ``runtime.forward`` + greedy pick + copy to host); ninfer prefill/TTFT of one ``prompt_len`` prompt;
the same through transformers' greedy ``generate`` with its default cache. The roofline of a decode step is the bytes
it must read (weights except the embedding table, for MoE the expected distinct routed experts; KV; recurrent state)
divided by the measured copy bandwidth.
"""

from __future__ import annotations

import json as json_module
import math
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ninfer.core.errors import ConfigError
from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.engine import greedy_token_ids
from ninfer.kernels.transfer import HostCopy
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.layers import DecoderLayerWeights, GatedDeltaNetWeights
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_runtime

PAGE_SIZE = 16
COPY_BYTES = 1 << 31  # 2 GiB: far beyond L2


class Clock:
    """Elapsed milliseconds: CUDA events on a GPU (after the work finishes), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def measure(self, work: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            work()
            return (time.perf_counter() - start) * 1e3
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop)

    def measure_from_mark(self, work: Callable[[Callable[[], None]], Any]) -> float:
        """Elapsed milliseconds from the point where ``work`` calls the function it is given (once; on a GPU: the
        device work queued by then done) to the end of ``work``."""
        if not self.cuda:
            marks: list[float] = []
            work(lambda: marks.append(time.perf_counter()))
            return (time.perf_counter() - marks[0]) * 1e3
        mark, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        work(mark.record)
        stop.record()
        torch.cuda.synchronize()
        return mark.elapsed_time(stop)


def copy_bandwidth(device: torch.device, clock: Clock, *, nbytes: int = COPY_BYTES, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats, after
    as many untimed copies: an idle GPU's first copies run slower, up to 10 % on the H200)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 26)
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    for _ in range(repeats):
        target.copy_(source)
    times = [clock.measure(lambda: target.copy_(source)) for _ in range(repeats)]
    return 2 * nbytes / (statistics.median(times) / 1e3)


def decode_bytes(config: Qwen35TextConfig, weight_bytes: int, expert_bytes: int, rows: int, context: int) -> float:
    """Bytes one decode step of ``rows`` rows at ``context`` cached tokens must read (bf16 weights/KV, fp32 state)."""
    if config.is_moe:  # routed experts: the expected number of distinct experts that ``rows`` tokens touch
        experts, top_k = config.num_experts, config.num_experts_per_tok
        touched = experts * (1 - (1 - top_k / experts) ** rows)
        weight_bytes = weight_bytes - expert_bytes + expert_bytes * touched / experts
    kv_per_token = 2 * len(config.full_attention_layers) * config.num_key_value_heads * config.head_dim * 2
    state_per_row = len(config.linear_attention_layers) * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        + config.conv_dim * (config.linear_conv_kernel_dim - 1) * 2
    )
    return weight_bytes + rows * (context * kv_per_token + state_per_row)


def step_bytes(runtime: Qwen35Runtime, rows: int, context: int) -> float:
    """``decode_bytes`` of ``runtime``'s model: what one decode step of ``rows`` rows at ``context`` tokens reads."""
    return decode_bytes(runtime.config, *_weight_bytes(runtime), rows, context)


def _weight_bytes(runtime: Qwen35Runtime) -> tuple[int, int]:
    """(bytes of every trunk weight except the embedding table, incl. lm_head; bytes of the routed experts)."""
    model = runtime.model
    seen: set[int] = set()
    total = expert = 0

    def count(tensor: torch.Tensor) -> int:
        key = tensor.data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return tensor.numel() * tensor.element_size()

    seen.add(model.embed_tokens.data_ptr())
    tensors: list[torch.Tensor] = [model.norm, model.lm_head]
    for layer in model.layers:
        for part in (layer.mixer, layer.mlp):
            for field in part.__attrs_attrs__:
                name, value = field.name, getattr(part, field.name)
                if isinstance(value, torch.Tensor):
                    size = count(value)
                    total += size
                    if name in ("gate_up", "down"):
                        expert += size
        tensors += [layer.input_layernorm, layer.post_attention_layernorm]
    return total + sum(count(t) for t in tensors), expert


class Rows:
    """KV pages and state slots for ``count`` rows of ``capacity`` tokens each, driven like the engine drives them."""

    def __init__(self, runtime: Qwen35Runtime, count: int, capacity: int) -> None:
        pages = math.ceil(capacity / PAGE_SIZE)
        self.runtime = runtime
        self.kv = KVCache.allocate(runtime.spec, count * pages, PAGE_SIZE)
        self.state = StateCache.allocate(runtime.spec, count)
        self.page_tables = torch.arange(count * pages, dtype=torch.int32).view(count, pages)
        self.slots = torch.arange(count)
        self.lengths = [0] * count
        # the engine's state_update_stops for rows that go on: every row feeds its token, one stop id (none matches)
        self.stops = torch.tensor([[1, -1]] * count, dtype=torch.int64, device=runtime.model.device)

    def forward(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append one chunk per row (all rows), return the greedy next token of every row on the host."""
        contexts = list(self.lengths)
        positions = torch.cat([torch.arange(c, c + len(t)) for c, t in zip(contexts, chunks)])
        batch = ForwardBatch(
            token_ids=torch.cat(list(chunks)),
            positions=positions.expand(3, -1),
            query_lens=[len(t) for t in chunks],
            context_lens=contexts,
            page_tables=self.page_tables,
            state_slots=self.slots,
            logits="last",
        )
        output = self.runtime.forward(batch, self.kv, self.state)
        self.lengths = [c + len(t) for c, t in zip(contexts, chunks)]
        return greedy_token_ids(output.logits).cpu()

    def forward_ahead(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed every row its token of ``tokens [R]``, still on the device (the last step's greedy ids, not yet on
        the host), as the engine's overlapped decode does; returns this step's greedy ids on the device (the argmax
        the forward takes with the logits where it does, as the engine asks it to for greedy rows)."""
        contexts = list(self.lengths)
        batch = ForwardBatch(
            token_ids=tokens,
            positions=torch.tensor(contexts).expand(3, -1),
            query_lens=[1] * len(contexts),
            context_lens=contexts,
            page_tables=self.page_tables,
            state_slots=self.slots,
            logits="last",
            state_update_stops=self.stops,
            greedy_below=self.runtime.spec.vocab_size,
        )
        output = self.runtime.forward(batch, self.kv, self.state)
        self.lengths = [c + 1 for c in contexts]
        return output.greedy_ids if output.greedy_ids is not None else greedy_token_ids(output.logits)


def bench_ninfer_decode(
    runtime: Qwen35Runtime, prompts: torch.Tensor, steps: int, clock: Clock, warmup: int = 8, overlap: bool = False
) -> tuple[float, list[int], float | None]:
    """(ms for ``steps`` decode steps of all rows in the steady state, greedy tokens of row 0 incl. the one from the
    prompt, ms of one bare graph replay back to back, without host work, or None without graphs).

    The clock starts when the first of ``steps + 1`` consecutive steps has finished on the device: the time the
    host takes to launch a loop's first step (0.24-0.45 ms once, 8-14 µs per step of 32 on the H200 with 35B-A3B)
    is not a per-token cost, and transformers' decode time (``bench_transformers``, a difference of two ``generate``
    calls) leaves its fixed costs out too.

    ``overlap``: each timed step is launched on the previous step's ids while they are still on the device, and the
    host then waits only for their copy (the engine's ``overlap_decode``); otherwise every step waits for its tokens
    on the host before the next is built.

    The ``warmup`` steps before the timed ones (the first captures the graph, the others run the timed loop: its
    first overlapped steps allocate pinned buffers) let the process settle: after only 3 of them the first timed
    steps of a fresh process run ~30 ms slower in all (H200, 27B: 14.6 against 14.2 ms per step over 64 steps)."""
    rows = Rows(runtime, prompts.shape[0], prompts.shape[1] + warmup + steps + 2)
    with torch.no_grad():
        tokens = rows.forward(list(prompts))
        generated = [int(tokens[0])]
        holder = {"tokens": rows.forward(list(tokens[:, None]))}  # the first decode step captures the graph
        generated.append(int(holder["tokens"][0]))

        def run(count: int, mark: Callable[[], None] = lambda: None) -> None:
            current = holder["tokens"]
            for step in range(count):
                current = rows.forward(list(current[:, None]))
                generated.append(int(current[0]))
                if not step:
                    mark()
            holder["tokens"] = current

        def run_overlapped(count: int, mark: Callable[[], None] = lambda: None) -> None:
            if not count:
                return
            ids = holder["tokens"].to(runtime.model.device)
            for step in range(count):
                copy = HostCopy(ids) if step else None  # the ids this step feeds reach the host while it runs
                following = rows.forward_ahead(ids)
                if not step:
                    mark()
                if copy is not None:
                    generated.append(int(copy.wait()[0]))
                ids = following
            generated.append(int(ids[0]))
            holder["tokens"] = ids.cpu()

        loop = run_overlapped if overlap else run
        loop(warmup - 1)  # the same loop as the timed steps: its first overlapped steps allocate pinned buffers
        elapsed = clock.measure_from_mark(lambda mark: loop(steps + 1, mark))
        replay_ms = None
        captured = runtime.decoder.captured(prompts.shape[0]) if runtime.decoder is not None else []
        if captured:
            step = captured[-1]  # the one bound to these rows' caches

            def replays(mark: Callable[[], None]) -> None:
                step.replay()
                mark()
                for _ in range(steps):
                    step.replay()

            replay_ms = clock.measure_from_mark(replays) / steps
    return elapsed, generated, replay_ms


def _top_kernels(prof: Any, top: int) -> list[dict[str, Any]]:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"kernel": e.key[:120], "calls": e.count, "total_us": e.device_time_total} for e in events[:top]]


def profile_prefill(runtime: Qwen35Runtime, prompt: torch.Tensor, top: int = 20) -> list[dict[str, Any]]:
    """Device time per kernel name of one single-chunk prefill of ``prompt`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    rows = Rows(runtime, 1, prompt.shape[0])
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        rows.forward([prompt])
    return _top_kernels(prof, top)


def profile_decode_step(runtime: Qwen35Runtime, context: int, top: int = 30) -> list[dict[str, Any]]:
    """Device time per kernel name of one eager batch-1 decode step of the fused path (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    decoder = runtime.decoder
    if decoder is None:
        return []
    rows = Rows(runtime, 1, context + 8)
    eager = decoder.use_graphs
    decoder.use_graphs = False
    try:
        with torch.no_grad():
            tokens = rows.forward([torch.randint(0, runtime.config.vocab_size, (context,))])
            tokens = rows.forward([tokens])
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                rows.forward([tokens])
    finally:
        decoder.use_graphs = eager
    return _top_kernels(prof, top)


def bench_ninfer_prefill(runtime: Qwen35Runtime, prompt: torch.Tensor, clock: Clock, repeats: int) -> float:
    """Median ms from submitting one ``prompt`` (a single chunk) to its first greedy token on the host."""
    warm_len = min(512, prompt.shape[0])
    with torch.no_grad():
        Rows(runtime, 1, warm_len).forward([prompt[:warm_len]])
        times = [clock.measure(_fresh_prefill(runtime, prompt)) for _ in range(repeats)]
    return statistics.median(times)


def _fresh_prefill(runtime: Qwen35Runtime, prompt: torch.Tensor) -> Callable[[], Any]:
    """A prefill of ``prompt`` into freshly allocated caches (allocated now, outside the timed call)."""
    rows = Rows(runtime, 1, prompt.shape[0])
    return lambda: rows.forward([prompt])


def _hf_classes(config: Qwen35TextConfig) -> tuple[type, type]:
    import transformers

    if config.is_moe:
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    return transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM


def build_transformers(config_dict: Mapping[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """transformers' own text model of the config, initialised by transformers directly on ``device``."""
    config = Qwen35TextConfig.from_hf(config_dict)
    config_class, model_class = _hf_classes(config)
    hf_config = config_class(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(hf_config, dtype=dtype)
    return model.eval()


def share_with_transformers(hf_model: Any) -> Callable[[int, DecoderLayerWeights], None]:
    """An ``on_layer`` hook that points transformers' projections at ninfer's fused views (frees the originals)."""

    def on_layer(index: int, layer: DecoderLayerWeights) -> None:
        hf_layer = hf_model.model.layers[index]
        mixer, mlp = layer.mixer, layer.mlp
        if isinstance(mixer, GatedDeltaNetWeights):
            attention = hf_layer.linear_attn
            pairs = [(attention.in_proj_qkv, mixer.in_proj_qkv), (attention.in_proj_z, mixer.in_proj_z),
                     (attention.in_proj_b, mixer.in_proj_b), (attention.in_proj_a, mixer.in_proj_a)]
        else:
            attention = hf_layer.self_attn
            pairs = [(attention.q_proj, mixer.q_proj), (attention.k_proj, mixer.k_proj),
                     (attention.v_proj, mixer.v_proj)]
        if hasattr(mlp, "gate_proj"):
            pairs += [(hf_layer.mlp.gate_proj, mlp.gate_proj), (hf_layer.mlp.up_proj, mlp.up_proj)]
        else:
            shared = hf_layer.mlp.shared_expert
            pairs += [(hf_layer.mlp.gate, mlp.router), (shared.gate_proj, mlp.shared_gate),
                      (shared.up_proj, mlp.shared_up), (hf_layer.mlp.shared_expert_gate, mlp.shared_expert_gate)]
        for module, view in pairs:
            module.weight.data = view

    return on_layer


def bench_transformers(
    hf_model: Any, prompts: torch.Tensor, steps: int, clock: Clock
) -> tuple[float, list[int]]:
    """(ms that ``steps`` extra greedy tokens add to ``generate`` for all rows, greedy tokens of row 0)."""
    device = next(hf_model.parameters()).device
    inputs = prompts.to(device)

    def generate(new_tokens: int) -> torch.Tensor:
        return hf_model.generate(
            inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )

    with torch.no_grad():
        generate(2)  # warm-up
        first = clock.measure(lambda: generate(1))
        holder: dict[str, torch.Tensor] = {}
        full = clock.measure(lambda: holder.setdefault("out", generate(1 + steps)))
    tokens = holder["out"][0, prompts.shape[1] :].tolist()
    return max(full - first, 1e-6), tokens


def bench_transformers_prefill(hf_model: Any, prompt: torch.Tensor, clock: Clock, repeats: int) -> float:
    device = next(hf_model.parameters()).device
    inputs = prompt[None, :].to(device)
    with torch.no_grad():
        times = [
            clock.measure(
                lambda: hf_model.generate(
                    inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=1, do_sample=False, pad_token_id=0
                ).cpu()
            )
            for _ in range(repeats)
        ]
    return statistics.median(times)


def _matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def run_synthetic_bench(
    name: str,
    *,
    concurrency: Sequence[int] = (1, 2, 4, 8),
    prompt_len: int = 8192,
    decode_steps: int = 32,
    decode_context: int = 256,
    transformers_decode_steps: int = 8,
    prefill_repeats: int = 2,
    compare_transformers: bool = True,
    cuda_graphs: bool = True,
    device: str | None = None,
    seed: int = 0,
    profile: bool = False,
    json: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark the named synthetic model (see the module doc); prints a table (or JSON) and returns the numbers.

    ``profile`` adds the device time per kernel of one eager batch-1 decode step and of one prefill (CUDA only).
    """
    if not concurrency or min(concurrency) < 1 or prompt_len < 1 or decode_steps < 1 or decode_context < 1:
        raise ConfigError("concurrency values, prompt_len, decode_steps and decode_context must be positive")
    config_dict = preset_config(name)
    config = Qwen35TextConfig.from_hf(config_dict)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    clock = Clock(target)
    bandwidth = copy_bandwidth(target, clock)
    hf_model = None
    if compare_transformers:
        hf_model = build_transformers(config_dict, target, dtype, seed)
        tensors = dict(hf_model.named_parameters())
        runtime = build_runtime(
            InMemorySource(name, config_dict, tensors), dtype=dtype, device=target, cuda_graphs=cuda_graphs,
            on_layer=share_with_transformers(hf_model),
        )
        del tensors
    else:
        runtime = random_runtime(name, device=target, dtype=dtype, seed=seed, cuda_graphs=cuda_graphs)
    weight_bytes, expert_bytes = _weight_bytes(runtime)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, config.vocab_size, (max(concurrency), decode_context), generator=generator)
    long_prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=generator)

    result: dict[str, Any] = {
        "model": name,
        "device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cuda_graphs": bool(cuda_graphs and runtime.decoder is not None),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_read_per_step": weight_bytes,
        "bytes_read_per_batch1_step": decode_bytes(config, weight_bytes, expert_bytes, 1, decode_context),
        "decode_context": decode_context,
        "decode_steps": decode_steps,
        "prompt_len": prompt_len,
        "decode": {},
        "prefill": {},
    }
    ninfer_tokens: list[int] = []
    overlap = target.type == "cuda"  # the engine's default there: each step launched before its tokens reach the host
    result["decode_overlapped"] = overlap
    for rows in concurrency:
        elapsed, tokens, replay_ms = bench_ninfer_decode(runtime, prompts[:rows], decode_steps, clock, overlap=overlap)
        if rows == 1:
            ninfer_tokens = tokens
        roofline = rows / (decode_bytes(config, weight_bytes, expert_bytes, rows, decode_context + 4) / bandwidth)
        tok_s = rows * decode_steps / (elapsed / 1e3)
        result["decode"][str(rows)] = {
            "roofline_tok_s": roofline,
            "ninfer": {
                "tok_s": tok_s, "step_ms": elapsed / decode_steps, "of_roofline": tok_s / roofline,
                "graph_replay_ms": replay_ms,
            },
        }
    if profile:
        result["decode_profile"] = profile_decode_step(runtime, decode_context)
    ttft = bench_ninfer_prefill(runtime, long_prompt, clock, prefill_repeats)
    result["prefill"]["ninfer"] = {"ttft_ms": ttft, "tok_s": prompt_len / (ttft / 1e3)}
    if profile and target.type == "cuda":
        result["prefill_profile"] = profile_prefill(runtime, long_prompt)
    if hf_model is not None:
        hf_tokens: list[int] = []
        for rows in concurrency:
            elapsed, tokens = bench_transformers(hf_model, prompts[:rows], transformers_decode_steps, clock)
            if rows == 1:
                hf_tokens = tokens
            entry = result["decode"][str(rows)]
            tok_s = rows * transformers_decode_steps / (elapsed / 1e3)
            entry["transformers"] = {"tok_s": tok_s, "of_roofline": tok_s / entry["roofline_tok_s"]}
            entry["ninfer_over_transformers"] = entry["ninfer"]["tok_s"] / tok_s
        hf_ttft = bench_transformers_prefill(hf_model, long_prompt, clock, prefill_repeats)
        result["prefill"]["transformers"] = {"ttft_ms": hf_ttft, "tok_s": prompt_len / (hf_ttft / 1e3)}
        result["prefill"]["ninfer_over_transformers"] = hf_ttft / ttft
        compared = min(len(ninfer_tokens), len(hf_tokens))
        result["greedy_agreement"] = {
            "compared": compared, "matching_prefix": _matching_prefix(ninfer_tokens, hf_tokens)
        }
    echo(json_module.dumps(result, indent=2) if json else format_table(result))
    return result


def format_table(result: Mapping[str, Any]) -> str:
    """A short human-readable summary of ``run_synthetic_bench``'s result."""
    lines = [
        f"{result['model']} on {result['device']} ({result['dtype']}, cuda graphs {result['cuda_graphs']}, "
        f"overlapped decode {result['decode_overlapped']}), "
        f"copy bandwidth {result['copy_bandwidth_gb_s']:.0f} GB/s, {result['weight_bytes_read_per_step'] / 1e9:.2f} GB "
        f"of weights, {result['bytes_read_per_batch1_step'] / 1e9:.2f} GB read by a batch-1 step",
        f"{'decode rows':>11} | {'roofline':>9} | {'ninfer tok/s':>12} | {'of roof':>7} | {'graph ms':>8} | "
        f"{'hf tok/s':>9} | {'of roof':>7} | {'ninfer/hf':>9}",
    ]
    for rows, entry in result["decode"].items():
        ours, theirs = entry["ninfer"], entry.get("transformers")
        replay = f"{ours['graph_replay_ms']:8.3f}" if ours.get("graph_replay_ms") else f"{'-':>8}"
        lines.append(
            f"{rows:>11} | {entry['roofline_tok_s']:9.1f} | {ours['tok_s']:12.1f} | {ours['of_roofline']:7.1%} | "
            f"{replay} | "
            + (f"{theirs['tok_s']:9.1f} | {theirs['of_roofline']:7.1%} | {entry['ninfer_over_transformers']:9.2f}"
               if theirs else f"{'-':>9} | {'-':>7} | {'-':>9}")
        )
    prefill = result["prefill"]
    hf = prefill.get("transformers")
    lines.append(
        f"prefill {result['prompt_len']} tokens: ninfer TTFT {prefill['ninfer']['ttft_ms']:.1f} ms "
        f"({prefill['ninfer']['tok_s']:.0f} tok/s)"
        + (f"; transformers TTFT {hf['ttft_ms']:.1f} ms ({hf['tok_s']:.0f} tok/s)" if hf else "")
    )
    if "greedy_agreement" in result:
        agreement = result["greedy_agreement"]
        lines.append(f"greedy tokens equal to transformers: {agreement['matching_prefix']}/{agreement['compared']}")
    return "\n".join(lines)

"""Engine-local reuse of stored Responses chains (session endpoints), against a live echo server with the SDK.

The server keeps only three checkpoints (``--device-state-slots 3``) and every anonymous Chat Completion leaves two
(prompt end and finish), so two of them between turns evict a plain LRU checkpoint: the store:false control chain
shows that. A stored chain's latest turn is its session endpoint and survives the same traffic, so each turn reuses
the whole previous turn (``cached_tokens`` >= previous input + output - 1: everything fed but the stop token).
Oracles: the echo model says the scripted text; input tokens are checked against the OFFICIAL Qwen template.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, tiny_artifact, words
from test_openai_chat import fence, official_prompt_tokens

from ninfer.protocols.openai_responses.adapter import root_session_key

THINK = {"preserve_thinking": True}  # the chain's history keeps its reasoning, so a finished turn is a prefix
_traffic = itertools.count()


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory):
    artifact = tiny_artifact(tmp_path_factory, "echo", "qwen3_6")
    # no host tier: the control chain must be able to lose its checkpoint to anonymous traffic
    args = ["--default-max-tokens", "256", "--device-state-slots", "3", "--host-state-slots", "0"]
    [server] = start_servers(tmp_path_factory.mktemp("sessions"), [(artifact, args, {})], [ECHO_MODEL])
    yield server
    server.stop()


def script(turn: str) -> str:
    return f"Thinking about {turn}.\n</think>\n\nAnswer for {turn}."


def traffic(server: LiveServer) -> None:
    """Two unrelated anonymous Chat Completions: four anonymous checkpoints, more than the three slots."""
    for _ in range(2):
        number = next(_traffic)
        reply = server.client().chat.completions.create(
            model=ECHO_MODEL, messages=[{"role": "user", "content": f"noise {number}: {words(5 + number % 4)}"}])
        assert reply.choices[0].finish_reason == "stop"


def whole_turn(response: Any) -> int:
    """The tokens a finished turn fed: its input and output but the final stop token."""
    return response.usage.input_tokens + response.usage.output_tokens - 1


def cached(response: Any) -> int:
    return response.usage.input_tokens_details.cached_tokens


def test_a_stored_chain_keeps_its_endpoint_through_anonymous_traffic(echo):
    client = echo.client()
    # control: the same turns without a session (store:false, full history replayed) lose their checkpoint
    fresh = client.responses.create(model=ECHO_MODEL, input=fence(script("c1")), store=False, extra_body=THINK)
    traffic(echo)
    replay = [{"role": "user", "content": fence(script("c1"))},
              *[item.model_dump(exclude_none=True) for item in fresh.output],
              {"role": "user", "content": fence(script("c2"))}]
    control = client.responses.create(model=ECHO_MODEL, input=replay, store=False, extra_body=THINK)
    assert control.output_text == "Answer for c2." and cached(control) < whole_turn(fresh)

    root = client.responses.create(model=ECHO_MODEL, input=fence(script("t1")), extra_body=THINK)
    assert root.output_text == "Answer for t1."
    traffic(echo)
    second = client.responses.create(model=ECHO_MODEL, previous_response_id=root.id, input=fence(script("t2")))
    assert second.output_text == "Answer for t2." and cached(second) >= whole_turn(root)
    traffic(echo)
    third = client.responses.create(model=ECHO_MODEL, previous_response_id=second.id, input=fence(script("t3")))
    assert third.output_text == "Answer for t3." and cached(third) >= whole_turn(second)
    history = [{"role": "user", "content": fence(script(turn))} if index % 2 == 0 else
               {"role": "assistant", "content": f"Answer for {turn}.", "reasoning_content": f"Thinking about {turn}."}
               for index, turn in enumerate(["t1", "t1", "t2", "t2", "t3"])]
    assert third.usage.input_tokens == official_prompt_tokens("qwen3_6", history, preserve_thinking=True)


def test_a_store_false_child_reads_the_endpoint_without_replacing_it(echo):
    client = echo.client()
    root = client.responses.create(model=ECHO_MODEL, input=fence(script("s1")), extra_body=THINK)
    traffic(echo)
    side = client.responses.create(model=ECHO_MODEL, previous_response_id=root.id, input=fence(script("side")),
                                   store=False)
    assert side.output_text == "Answer for side." and cached(side) >= whole_turn(root)
    traffic(echo)  # evicts the side branch's anonymous checkpoint; the chain's endpoint stays
    child = client.responses.create(model=ECHO_MODEL, previous_response_id=root.id, input=fence(script("s2")))
    assert child.output_text == "Answer for s2." and cached(child) >= whole_turn(root)


def test_the_session_key_never_reaches_the_wire(echo):
    client = echo.client()
    root = client.responses.create(model=ECHO_MODEL, input=fence(script("w1")), extra_body=THINK)
    key = root_session_key(root.id)
    body = {"model": ECHO_MODEL, "previous_response_id": root.id, "input": fence(script("w2"))}
    texts = [httpx.post(echo.url("/v1/responses"), json=body, timeout=60).text]
    with httpx.stream("POST", echo.url("/v1/responses"), json={**body, "stream": True}, timeout=60) as streamed:
        assert streamed.status_code == 200
        texts.append(streamed.read().decode())
    side = httpx.post(echo.url("/v1/responses"), json={**body, "store": False}, timeout=60)
    texts += [side.text, httpx.get(echo.url(f"/v1/responses/{root.id}"), timeout=30).text,
              httpx.get(echo.url(f"/v1/responses/{root.id}/input_items"), timeout=30).text]
    assert all('"status":"completed"' in text.replace(" ", "") for text in texts[:3])
    for text in texts:
        assert key not in text and "session" not in text

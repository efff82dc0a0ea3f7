"""POST /v1/responses over the fake engine with the official client: plain and streamed
(event names, order, sequence numbers), the input item kinds, and the 400s for what a
stateless server cannot do."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.live_server import start_server
from tests.server.fake_engine import REPLY, FakeEngine, fake_backend_factory

MODEL = "fake-model"
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    server = start_server(fake_backend_factory(engine))
    yield server.url, engine
    server.stop()


@pytest.fixture
def client(fake):
    return openai.OpenAI(base_url=f"{fake[0]}/v1", api_key="x", max_retries=0)


def test_plain_response(client, fake):
    resp = client.responses.create(model=MODEL, input="What is the capital of France?")
    assert resp.object == "response" and resp.status == "completed"
    assert resp.output_text == REPLY
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert resp.usage.output_tokens == len(REPLY.encode()) + 1  # + EOS
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert not fake[1].live


def test_instructions_and_items_become_the_chat_conversation(client, fake):
    engine = fake[1]
    client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        ],
        max_output_tokens=4,
    )
    prompt = bytes(t for t in engine.submitted[-1].prompt_ids if t < 256).decode()
    assert (
        prompt == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello!\n<|user|>Q\n<|assistant|>"
    )


def test_max_output_tokens_makes_an_incomplete_response(client):
    resp = client.responses.create(model=MODEL, input="x", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == REPLY[:3] and resp.usage.output_tokens == 3


def test_streamed_events_follow_openai_order(client):
    events = list(client.responses.create(model=MODEL, input="x", stream=True))
    types = [e.type for e in events]
    assert types[:4] == STREAM_ORDER
    assert types[-4:] == [*STREAM_END, "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert "".join(d.delta for d in deltas) == REPLY
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == REPLY and final.usage.output_tokens > 0
    assert events[-4].text == REPLY


def test_the_stream_helper_gives_the_final_response(client):
    with client.responses.stream(model=MODEL, input="x") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == REPLY == final.output_text and final.status == "completed"


def test_a_stream_cut_at_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model=MODEL, input="x", stream=True, max_output_tokens=5))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == REPLY[:5]
    assert events[-2].item.status == "incomplete"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"reasoning": {"effort": "ultra"}}, "reasoning_effort"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.role"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
        ({"input": "x" * 5000}, "input"),  # past the fake engine's context
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(fake, extra, param):
    resp = httpx.post(f"{fake[0]}/v1/responses", json={"input": "hi", **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert not fake[1].live


def test_fields_that_change_nothing_are_accepted(client):
    resp = client.responses.create(
        model=MODEL,
        input="x",
        max_output_tokens=2,
        store=False,
        metadata={"k": "v"},
        user="u",
        service_tier="auto",
        truncation="disabled",
        reasoning={"effort": "low"},
    )
    assert resp.status == "incomplete" and resp.metadata == {"k": "v"}

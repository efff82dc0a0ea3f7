"""/v1/messages against the real SmolLM2 with the official `anthropic` SDK: a greedy answer,
the stream equal to it, count_tokens and the prefix cache's hit in usage, forced tool use and
its round trip, a prefill, output_config.format."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.model

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # NOTE: the 2.x SDK has no temperature argument; the API has
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def client(live_server):
    return anthropic.Anthropic(base_url=live_server.url, api_key="none", max_retries=0)


@pytest.fixture
def model(live_server):
    return live_server.app.state.backend.model_name


def test_greedy_answer_streamed_equals_whole_and_usage(client, model):
    args = {"model": model, "max_tokens": 24, "messages": ASK, "extra_body": GREEDY}
    # the same cache state for the compared requests (tests/server/test_server_live.py)
    client.messages.create(**{**args, "max_tokens": 1})
    whole = client.messages.create(**args)
    assert whole.content[0].type == "text" and "Paris" in whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    count = client.messages.count_tokens(model=model, messages=ASK).input_tokens
    for usage in (whole.usage, final.usage):
        assert usage.cache_read_input_tokens > 0  # the same prompt again
        assert usage.input_tokens + usage.cache_read_input_tokens == count


def test_forced_tool_use_and_the_round_trip(client, model):
    args = {"model": model, "max_tokens": 64, "tools": [WEATHER], "extra_body": GREEDY}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "any", "disable_parallel_tool_use": True}
    msg = client.messages.create(**args, messages=ask, tool_choice=choice)
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]  # one: no parallel calls
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    named = client.messages.create(
        **args, messages=ask, tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert [b.type for b in named.content] == ["tool_use"]
    answer = client.messages.create(
        **args,
        messages=[
            *ask,
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ],
        tool_choice={"type": "none"},
    )  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content[0].type == "text" and answer.content[0].text


def test_a_prefill_is_continued(client, model):
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    msg = client.messages.create(model=model, max_tokens=8, messages=prefill, extra_body=GREEDY)
    text = msg.content[0].text
    assert "Paris" in text and not text.startswith("The capital")  # the continuation only


def test_output_config_format_is_enforced(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=model,
        max_tokens=40,
        messages=ASK,
        extra_body={
            **GREEDY,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)

"""/v1/responses with function tools over the fake engine (its reply is a Hermes tool call):
function_call output items, their stream events, and a second turn that sends the call and
its output back as input items."""

from __future__ import annotations

import json

import openai
import pytest

from server.backend import Backend
from tests.live_server import start_server
from tests.server.fake_engine import FakeEngine, FakeTemplate, FakeTokenizer

MODEL = "fake-model"
ARGS = {"city": "Paris"}
CALL = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': ARGS})}\n</tool_call>"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class ToolTemplate(FakeTemplate):
    """Renders tool calls and tool results, and lists the tools it was given."""

    def render(self, messages, add_generation_prompt=True, **kwargs) -> str:
        lines = [f"<|tools|>{json.dumps(kwargs['tools'])}\n"] if kwargs.get("tools") else []
        for m in messages:
            calls = json.dumps(m["tool_calls"]) if m.get("tool_calls") else ""
            lines.append(f"<|{m['role']}|>{m.get('tool_call_id', '')}{m['content']}{calls}\n")
        return "".join(lines) + ("<|assistant|>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(reply=CALL)

    def factory(settings, on_step) -> Backend:
        return Backend(engine, FakeTokenizer(), ToolTemplate(), MODEL, 2048, 4096, 0)

    server = start_server(factory)
    yield server.url, engine
    server.stop()


@pytest.fixture
def client(fake):
    return openai.OpenAI(base_url=f"{fake[0]}/v1", api_key="x", max_retries=0)


def prompt_text(engine: FakeEngine) -> str:
    return bytes(t for t in engine.submitted[-1].prompt_ids if t < 256).decode()


def test_a_tool_call_is_a_function_call_item(client, fake):
    resp = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL])
    assert resp.status == "completed"
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == ARGS and call.call_id
    assert '"name": "get_weather"' in prompt_text(fake[1])  # the template saw the tool


def test_a_streamed_tool_call(client):
    events = list(client.responses.create(model=MODEL, input="x", tools=[TOOL], stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[5].item
    assert added.type == "function_call" and added.arguments == "" and added.name == "get_weather"
    assert json.loads(done.arguments) == ARGS and done.call_id == added.call_id
    assert events[-1].response.output[0].call_id == added.call_id


def test_the_call_and_its_output_go_back_as_input(client, fake):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL])
    call = first.output[0]
    client.responses.create(
        model=MODEL,
        tools=[TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
    )  # fmt: skip
    prompt = prompt_text(fake[1])
    assert f'"id": "{call.call_id}"' in prompt and '"get_weather"' in prompt
    assert f"<|tool|>{call.call_id}sunny, 21 C" in prompt


def test_tool_choice_none_hides_the_tools(client, fake):
    resp = client.responses.create(model=MODEL, input="x", tools=[TOOL], tool_choice="none")
    assert "<|tools|>" not in prompt_text(fake[1])
    assert resp.output[0].type == "message"  # the text is not parsed for calls

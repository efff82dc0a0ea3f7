"""Tool calling against the real SmolLM2 server: the openai SDK and LangChain's ChatOpenAI."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.test_server_live import wait_idle

pytestmark = pytest.mark.model

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 20}},
                "required": ["zone"],
                # NOTE: closed, as OpenAI's strict tools are: with extra keys allowed, SmolLM2
                # on the AVX2 path wandered into invented properties past max_tokens
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_calls_validate(client, model) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        temperature=1.0,
        seed=2,
        max_tokens=64,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_named_tool_streamed_is_reassembled_by_the_sdk(client, model) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    with client.chat.completions.stream(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=64
    ) as stream:
        kinds = {type(event).__name__ for event in stream}
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert_valid_calls(choice.message.tool_calls)
    assert "FunctionToolCallArgumentsDoneEvent" in kinds


def test_parallel_calls_are_all_valid(client, model) -> None:
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", seed=2, max_tokens=64
    )
    assert_valid_calls(out.choices[0].message.tool_calls)  # a call cut by length is dropped


def test_tool_choice_none_is_plain_text(client, model) -> None:
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_tool_round_trip_renders_the_history(client, model, live_server) -> None:
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=64,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    final = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=24, temperature=0.0
    )
    assert final.choices[0].message.content
    tokens = httpx.post(
        f"{live_server.url}/tokenize", json={"messages": history, "tools": TOOLS}
    ).json()
    assert tokens["count"] == final.usage.prompt_tokens  # /tokenize renders what chat does
    prompt = httpx.post(f"{live_server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    payload = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    assert prompt["prompt"].endswith(
        f"<|im_start|>assistant\n<tool_call>\n{json.dumps(payload)}\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert prompt["prompt"].startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in prompt["prompt"]


def test_an_unknown_named_tool_is_a_400(live_server) -> None:
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    }
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    wait_idle(live_server.url)


class Weather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Answer(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


def test_langchain_structured_output_and_bind_tools(live_server, model) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{live_server.url}/v1",
        api_key="none",
        model=model,
        max_tokens=100,  # a non-strict tool admits extra arguments: room for them
        temperature=0.0,
        max_retries=0,
    )
    answer = llm.with_structured_output(Answer).invoke("Is it sunny in Rome?")
    assert isinstance(answer, Answer)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in message.tool_calls] == ["Weather"]
    Weather.model_validate(message.tool_calls[0]["args"])
    bound = llm.bind_tools([Weather], tool_choice="any", strict=True, parallel_tool_calls=False)
    message = bound.invoke("Weather in Oslo?")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert len(message.tool_calls) == 1
    Weather.model_validate(message.tool_calls[0]["args"])

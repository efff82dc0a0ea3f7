"""POST /v1/messages and /v1/messages/count_tokens over the fake engine, driven by the official
`anthropic` SDK: whole and streamed messages, stop reasons, tool use and its round trip,
thinking blocks, x-api-key auth and Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.backend import Backend
from tests.live_server import start_server
from tests.server.fake_engine import REPLY, FakeEngine, FakeTokenizer
from tests.server.test_responses_tools import CALL, ToolTemplate

MODEL = "fake-model"
KEY = "secret-key"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()

    def factory(settings, on_step) -> Backend:
        return Backend(engine, FakeTokenizer(), ToolTemplate(), MODEL, 2048, 4096, 0)

    server = start_server(factory, api_key=KEY)
    yield server.url, engine
    server.stop()


@pytest.fixture
def engine(fake):
    fake[1].reply = REPLY
    yield fake[1]
    fake[1].reply = REPLY


@pytest.fixture
def client(fake):
    return anthropic.Anthropic(base_url=fake[0], api_key=KEY, max_retries=0)


def prompt_text(engine: FakeEngine) -> str:
    return bytes(t for t in engine.submitted[-1].prompt_ids if t < 256).decode()


def raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages, as they came."""
    headers = {"x-api-key": KEY}
    resp = httpx.post(f"{url}/v1/messages", json={**body, "stream": True}, headers=headers)
    assert resp.status_code == 200
    events, name = [], None
    for line in resp.text.splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line[5:])))
    return events


def test_a_message_with_a_system_prompt(client, engine):
    msg = client.messages.create(
        model=MODEL,
        max_tokens=200,
        system=[{"type": "text", "text": "Be brief."}],
        messages=ASK,
        metadata={"user_id": "u-1"},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == REPLY
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert prompt_text(engine).startswith("<|system|>Be brief.\n<|user|>What is the capital")
    assert msg.usage.output_tokens == len(REPLY.encode()) + 1  # + EOS
    assert msg.usage.input_tokens == len(engine.submitted[-1].prompt_ids)
    assert msg.usage.cache_read_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    assert count.input_tokens == msg.usage.input_tokens


def test_sampling_fields_reach_the_engine(client, engine):
    # NOTE: this SDK (2.x) no longer has temperature / top_p / top_k arguments; older SDKs
    # and other clients (LangChain's ChatAnthropic) still send them
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 20}
    client.messages.create(model=MODEL, max_tokens=7, messages=ASK, extra_body=sampling)
    req = engine.submitted[-1]
    assert req.max_tokens == 7
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (0.5, 0.9, 20)


def test_max_tokens_and_stop_sequences(client, engine):
    cut = client.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == REPLY[:5]
    stopped = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, stop_sequences=["zzz", "Paris"]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == REPLY[: REPLY.index("Paris")]
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=ASK, stop_sequences=["Paris"]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    assert final.content[0].text == stopped.content[0].text


def test_streamed_equals_whole(client, engine):
    whole = client.messages.create(model=MODEL, max_tokens=200, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_event_sequence(fake, engine):
    events = raw_events(fake[0], {"model": MODEL, "max_tokens": 200, "messages": ASK})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [d["delta"] for _, d in events[3:-3]]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == REPLY
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == len(REPLY.encode()) + 1


def test_tool_use_and_its_round_trip(client, engine):
    engine.reply = CALL
    msg = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice={"type": "auto"}
    )
    assert msg.stop_reason == "tool_use"
    [call] = msg.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"} and call.id
    assert '"name": "get_weather"' in prompt_text(engine)  # the template saw the tool
    engine.reply = "It is sunny."
    answer = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=[WEATHER],
        messages=[
            *ASK,
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks."},
            ]},
        ],
    )  # fmt: skip
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is sunny."
    prompt = prompt_text(engine)
    assert f'<|assistant|>Let me look.[{{"id": "{call.id}"' in prompt
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in prompt
    assert f"<|tool|>{call.id}sunny, 21 C\n<|user|>Thanks.\n<|assistant|>" in prompt


def test_a_streamed_tool_use(client, fake, engine):
    engine.reply = CALL
    body = {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": [WEATHER]}
    events = raw_events(fake[0], body)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    delta = events[3][1]["delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == {"city": "Paris"}
    assert events[5][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER]) as s:
        final = s.get_final_message()
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_tool_choice_none_hides_the_tools(client, engine):
    engine.reply = CALL
    msg = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert "<|tools|>" not in prompt_text(engine)
    assert msg.content[0].type == "text" and msg.stop_reason == "end_turn"


def test_thinking_blocks(client, fake, engine):
    engine.reply = "<think>France's capital.</think>\n\nParis."
    msg = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, thinking={"type": "enabled", "budget_tokens": 64}
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "France's capital." and msg.content[1].text == "Paris."
    events = raw_events(fake[0], {"model": MODEL, "max_tokens": 200, "messages": ASK})
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    kinds = {d["delta"]["type"] for n, d in events if n == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta"}
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == "France's capital." and final.content[1].text == "Paris."


def test_thinking_blocks_sent_back_are_skipped(client, engine):
    client.messages.create(
        model=MODEL,
        max_tokens=10,
        messages=[
            *ASK,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Paris."},
            ]},
            {"role": "user", "content": "And Italy?"},
        ],
    )  # fmt: skip
    assert "hmm" not in prompt_text(engine)
    assert "<|assistant|>Paris.\n<|user|>And Italy?" in prompt_text(engine)


def test_a_final_assistant_message_is_continued(client, fake, engine):
    prefill = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=prefill)
    assert prompt_text(engine).endswith(
        "<|user|>What is the capital of France?\n<|assistant|>It is"
    )
    assert msg.content[0].text == REPLY  # the continuation only, as Anthropic answers
    count = client.messages.count_tokens(model=MODEL, messages=prefill)
    assert count.input_tokens == msg.usage.input_tokens
    # the same on /v1/chat/completions, vLLM's continue_final_message
    chat = {"model": MODEL, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}
    headers = {"x-api-key": KEY}
    both = httpx.post(
        f"{fake[0]}/v1/chat/completions",
        json={**chat, "continue_final_message": True},
        headers=headers,
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    ok = httpx.post(
        f"{fake[0]}/v1/chat/completions",
        json={**chat, "continue_final_message": True, "add_generation_prompt": False},
        headers=headers,
    )
    assert ok.status_code == 200 and prompt_text(engine).endswith("<|assistant|>It is")


def test_x_api_key_and_bearer_both_work(fake):
    url = fake[0]
    body = {"model": MODEL, "max_tokens": 3, "messages": ASK}
    assert httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}).is_success
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/v1/messages", json=body, headers=bearer).is_success
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).is_success
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=3, messages=ASK)
    assert err.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "incorrect API key"},
    }
    missing = httpx.post(f"{url}/v1/messages", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "status", "where"),
    [
        ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
        ({"model": "claude-x", "max_tokens": 5, "messages": ASK}, 404, "claude-x"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]}, 400, "messages.0.content.0.type"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}},
         400, "tool_choice"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice.name"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400,
         "temperature"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "mcp_servers": [{"url": "x"}]},
         400, "mcp_servers"),
        ({"model": MODEL, "max_tokens": 5, "messages": [
            *ASK, {"role": "assistant", "content": "The capital is "}]}, 400, "whitespace"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "stop_sequences": list("abcde")},
         400, "stop_sequences"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [7]}]}]}, 400,
         "messages.0.content.0.content.0"),
    ],
)  # fmt: skip
def test_bad_requests_answer_in_anthropics_error_shape(fake, body, status, where):
    resp = httpx.post(f"{fake[0]}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert resp.status_code == status
    out = resp.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    assert out["error"]["type"] == kind
    assert where in out["error"]["message"]


def test_sdk_errors_and_openai_routes_keep_their_shape(client, fake):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=ASK)
    chat = httpx.post(
        f"{fake[0]}/v1/chat/completions",
        json={"model": "nope", "messages": ASK},
        headers={"x-api-key": KEY},
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"


def test_langchain_chat_anthropic(fake, engine):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model=MODEL, base_url=fake[0], api_key=KEY, max_tokens=200, temperature=0, max_retries=0
    )
    answer = llm.invoke("What is the capital of France?")
    assert answer.content == REPLY
    assert answer.response_metadata["stop_reason"] == "end_turn"
    assert engine.submitted[-1].sampling.temperature == 0
    assert "".join(chunk.text for chunk in llm.stream("Capital of France?")) == REPLY
    engine.reply = CALL
    call = llm.bind_tools([WEATHER]).invoke("Weather in Paris?")
    assert call.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": call.tool_calls[0]["id"],
         "type": "tool_call"}
    ]  # fmt: skip


def test_a_full_queue_is_a_rate_limit_error(client, fake, engine):
    engine.max_running = 0
    try:
        body = {"model": MODEL, "max_tokens": 5, "messages": ASK, "stream": True}
        resp = httpx.post(f"{fake[0]}/v1/messages", json=body, headers={"x-api-key": KEY})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    finally:
        engine.max_running = 64

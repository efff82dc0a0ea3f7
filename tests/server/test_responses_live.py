"""/v1/responses with the real model and the official client: plain and streamed agree."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)


def test_plain_and_streamed_responses_agree(client):
    model = client.models.list().data[0].id
    ask = dict(
        model=model,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    plain = client.responses.create(**ask)
    assert plain.status in ("completed", "incomplete") and plain.output_text.strip()
    assert plain.usage.input_tokens > 10 and 0 < plain.usage.output_tokens <= 24
    events = list(client.responses.create(**ask, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": ask["instructions"]},
            {"role": "user", "content": ask["input"]},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == plain.output_text  # the same pipeline


def test_text_format_json_schema_constrains_the_output(client):
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=model,
        input="Give the largest city of France and its population as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert resp.status == "completed", resp.output_text
    data = json.loads(resp.output_text)
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)
    assert resp.text.format.type == "json_schema"

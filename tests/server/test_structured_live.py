"""Structured outputs against the real SmolLM2 server, through the official openai SDK."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.test_server_live import wait_idle

pytestmark = pytest.mark.model

ASK = [{"role": "user", "content": "Describe a pet."}]
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "kind", "age", "tags"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def test_parse_returns_a_parsed_object_20_of_20_at_temperature_1(live_server, model) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="none", max_retries=0)

    async def one(seed: int):
        return await aclient.chat.completions.parse(
            model=model,
            messages=ASK,
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )

    async def all_of_them():
        return await asyncio.gather(*(one(seed) for seed in range(20)))

    results = asyncio.run(all_of_them())
    parsed = [r.choices[0].message.parsed for r in results]
    assert all(isinstance(p, Pet) for p in parsed)
    assert len({p.model_dump_json() for p in parsed}) > 1  # sampled, not one canned answer
    wait_idle(live_server.url)


def test_strict_json_schema_validates(client, model) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True},
    }
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        response_format=response_format,
        temperature=0.8,
        n=4,
        seed=1,
        max_tokens=80,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_json_object_and_a_streamed_schema(client, model) -> None:
    # NOTE: any object: nothing bounds its length but max_tokens, so greedy to keep it short
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=100,
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PET_SCHEMA}},
        max_tokens=80,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PET_SCHEMA)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ({"guided_choice": ["red", "green"]}, r"red|green"),
        ({"grammar": 'root ::= "A" [0-9] [0-9]'}, r"A[0-9]{2}"),  # llama.cpp GBNF
        ({"structured_outputs": {"grammar": 'start: "B" /[a-c]+/'}}, r"B[a-c]+"),  # Lark
    ],
)
def test_vllm_and_llamacpp_fields(client, model, extra, check) -> None:
    import re

    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=20, temperature=1.0, seed=3, extra_body=extra
    )
    assert re.fullmatch(check, out.choices[0].message.content)


def test_completions_take_a_json_schema(live_server) -> None:
    body = {"prompt": "A pet:", "max_tokens": 80, "guided_json": PET_SCHEMA}
    out = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=120).json()
    jsonschema.validate(json.loads(out["choices"][0]["text"]), PET_SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
            "objectx",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed"),
        ({"grammar": "root ::= ("}, "grammar", "GBNF"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(live_server, extra, param, words) -> None:
    body = {"messages": ASK, "max_tokens": 8, **extra}
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert error["type"] and "code" in error
    wait_idle(live_server.url)


def test_a_grammar_the_tokens_cannot_follow_is_a_400_and_others_go_on(live_server) -> None:
    # byte 0x14 in a regex: llguidance's mask after "a" lets through a token its matcher then
    # rejects (found by schemathesis): the request's grammar is at fault, not the engine
    url = f"{live_server.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 8, "guided_regex": "a\u0014b"}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_error" and "cannot follow" in error["message"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "grammar_error"
    ok = httpx.post(url, json={**body, "guided_regex": "ab"}, timeout=60).json()
    assert ok["choices"][0]["text"] == "ab"
    wait_idle(live_server.url)

"""llama.cpp's probe endpoints on a tiny random model: GET /props, POST /apply-template, and
/tokenize with llama.cpp's `content` / `add_special` / `with_pieces`."""

from __future__ import annotations

import httpx
import pytest

from model.load.chat_template import CHATML_TEMPLATE
from tests.live_server import start_server
from tests.tiny_models import write_tiny_llama

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world!"},
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny")
    server = start_server(model=str(folder), n_cells=256, ctx_per_seq=128, n_seq_max=4)
    yield server.url
    server.stop()


def test_props_describe_the_served_model(url):
    props = httpx.get(f"{url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 128
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0
    assert props["total_slots"] == 4 and props["model_alias"] == "tiny"
    assert props["chat_template"] == CHATML_TEMPLATE
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["eos_token"] == "<|im_end|>"


def test_apply_template_is_the_prompt_chat_would_tokenize(url):
    prompt = httpx.post(f"{url}/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    by_text = httpx.post(f"{url}/tokenize", json={"content": prompt}).json()["tokens"]
    by_messages = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert by_text == by_messages
    bad = httpx.post(f"{url}/apply-template", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_tokenize_with_pieces(url):
    text = "Hello é"
    plain = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False}).json()
    out = httpx.post(
        f"{url}/tokenize", json={"content": text, "add_special": False, "with_pieces": True}
    ).json()
    assert [t["id"] for t in out["tokens"]] == plain["tokens"] and out["count"] == plain["count"]
    pieces = [t["piece"] for t in out["tokens"]]
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces)
    assert raw.decode() == text
    # "é" is two byte tokens in this vocabulary: neither is UTF-8 alone, so both are bytes
    assert pieces[-2:] == [[0xC3], [0xA9]]

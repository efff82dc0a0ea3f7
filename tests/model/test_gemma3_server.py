"""Gemma-3-270M behind the real server: its GGUF has no chat template, so chat answers 400 and
names --chat-template while /v1/completions serves; --chat-template on a tiny model."""

from __future__ import annotations

import os

import httpx
import pytest

from model.errors import ModelLoadError
from model.load.chat_template import read_template
from model.load.loader import load_model
from model.load.packaged import GEMMA3_INSTALL, gemma3_270m_path, gemma3_installed
from tests.live_server import start_server
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.model

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def gemma_server():
    if not gemma3_installed():
        reason = f"the Gemma-3-270M packages are not installed: {GEMMA3_INSTALL}"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(reason + " (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    server = start_server(model=str(gemma3_270m_path()), n_cells=1024, ctx_per_seq=512)
    yield server
    server.stop()


def test_chat_without_a_template_is_a_400_naming_the_flag(gemma_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = httpx.post(f"{gemma_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "no_chat_template" and err["param"] == "messages"
    assert err["type"] == "invalid_request_error"
    assert "--chat-template" in err["message"] and "/v1/completions" in err["message"]
    tok = httpx.post(f"{gemma_server.url}/tokenize", json={"messages": body["messages"]})
    assert tok.status_code == 400 and tok.json()["error"]["code"] == "no_chat_template"


def test_completions_serve_gemma(gemma_server):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{gemma_server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"].strip()
    tok = httpx.post(f"{gemma_server.url}/tokenize", json={"prompt": body["prompt"]}).json()
    assert tok["tokens"][0] == 2 and out["usage"]["prompt_tokens"] == tok["count"]  # <bos>


def test_chat_template_flag_replaces_the_models_own(tmp_path):
    folder = write_tiny_llama(tmp_path / "tiny")
    server = start_server(model=str(folder), chat_template=TEMPLATE, n_cells=256)
    try:
        msgs = [{"role": "user", "content": "hello world"}]
        tok = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
        plain = httpx.post(f"{server.url}/tokenize", json={"prompt": "[user]hello world\n"})
        assert tok["tokens"] == plain.json()["tokens"]
    finally:
        server.stop()


def test_chat_template_is_a_file_or_a_template(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    assert read_template(str(file)) == TEMPLATE == read_template(TEMPLATE)
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        read_template(str(tmp_path / "missing.jinja"))
    loaded = load_model(write_tiny_llama(tmp_path / "tiny"), chat_template=str(file))
    assert loaded.chat_template is not None and loaded.chat_template.source == TEMPLATE

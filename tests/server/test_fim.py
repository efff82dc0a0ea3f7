"""Fill-in-the-middle: the FIM tokens (vocabulary spellings, GGUF metadata), the exact prompt
llama.cpp's format_prompt_infill builds, POST /infill and OpenAI's `suffix` on
/v1/completions (fake engine: the submitted ids; a tiny random model with Qwen2.5-Coder's
FIM tokens: the real pipeline), the 400 for a model without them, and llama.cpp's n_indent /
t_max_predict_ms stops."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.load.loader import load_model
from model.load.tokenizer import Tokenizer
from server.backend import Backend
from server.errors import APIError
from server.fim import ExtraChunk, FimTokens, FimWindow, fim_tokens, infill_ids
from server.line_limits import LineLimits
from tests.live_server import start_server
from tests.server.fake_engine import BOS, FakeEngine, FakeTemplate, FakeTokenizer
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

WIDE = FimWindow(n_batch=2048, n_ctx=4096, n_predict=16)
EXTRA = [ExtraChunk("util.py", "def add(a, b):\n    return a + b\n")]


@pytest.fixture(scope="module")
def fim_folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fim") / "tiny", fim=True)


@pytest.fixture(scope="module")
def tok(fim_folder):
    return Tokenizer.from_hf_dir(fim_folder)


def ids_of(tok: Tokenizer, *names: str) -> list[int]:
    return [tok.hf.token_to_id(n) for n in names]


def test_the_vocabulary_spellings_are_found(tok):
    fim = fim_tokens(tok, "tiny", "input_prefix")
    pre, suf, mid, pad, rep, sep = ids_of(
        tok,
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    )
    assert fim == FimTokens(pre, suf, mid, pad, rep, sep)
    assert fim.stop_ids == {pad, rep, sep}


def test_the_gguf_metadata_wins_over_the_vocabulary(fim_folder, tmp_path):
    tok = Tokenizer.from_hf_dir(fim_folder)
    [prefix_token, repo_token] = ids_of(tok, "<|fim_prefix|>", "<|repo_name|>")
    # metadata that names other ids than the spellings: the loader and server/fim.py take it
    path = write_tiny_gguf(
        tmp_path / "fim.gguf", fim_folder, fim_ids={"pre": repo_token, "rep": prefix_token}
    )
    loaded = load_model(path)
    assert loaded.tokenizer.fim_ids == {"pre": repo_token, "rep": prefix_token}
    fim = fim_tokens(loaded.tokenizer, "tiny", "input_prefix")
    assert (fim.pre, fim.rep) == (repo_token, prefix_token)
    assert fim.mid == tok.hf.token_to_id("<|fim_middle|>")  # the rest from the vocabulary


def test_a_model_without_fim_tokens_is_refused(tmp_path):
    plain = Tokenizer.from_hf_dir(write_tiny_llama(tmp_path / "plain"))
    with pytest.raises(APIError) as err:
        fim_tokens(plain, "plain", "input_prefix")
    assert err.value.status == 400 and err.value.code == "fim_not_supported"
    assert "no prefix, suffix, middle token" in err.value.message


def test_the_prompt_is_llama_cpps_repo_level_pattern(tok):
    fim = fim_tokens(tok, "tiny", "input_prefix")
    prefix, suffix, prompt = "def mul(a, b):\n    ", "\n\nprint(mul(2, 3))\n", "ret"
    ids = infill_ids(tok, fim, prefix, suffix, EXTRA, prompt, WIDE)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False)

    rep, sep, pre, suf, mid = ids_of(
        tok, "<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
    )
    assert ids == [
        rep, *enc("myproject\n"),
        sep, *enc("util.py\n"), *enc(EXTRA[0].text),
        sep, *enc("filename\n"),
        pre, *enc(prefix), *enc(prompt),
        suf, *enc(suffix),
        mid,
    ]  # fmt: skip


def test_the_window_keeps_the_prefix_end_the_suffix_start_and_the_last_extra(tok):
    fim = fim_tokens(tok, "tiny", "input_prefix")
    prefix, suffix = "hello world " * 20, "the lazy dog " * 20

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False)

    # n_batch 16: prefix 3 * 4 = 12 tokens, suffix 4 - 2 - 0 = 2; extra: 48 - 16 - 2 * 4 = 24
    ids = infill_ids(tok, fim, prefix, suffix, EXTRA * 5, "", FimWindow(16, 48, 4))
    extra = ids[: ids.index(fim.pre)]
    assert len(extra) == 24
    whole_extra = infill_ids(tok, fim, "", "", EXTRA * 5, "", WIDE)
    assert extra == whole_extra[: whole_extra.index(fim.pre)][-24:]
    body = ids[len(extra) :]
    assert body == [fim.pre, *enc(prefix)[-12:], fim.suf, *enc(suffix)[:2], fim.mid]


def test_n_indent_cuts_the_first_under_indented_line():
    limits = LineLimits(n_indent=4, t_max_predict_ms=0)
    text = "x = 1\n    y = 2\n\tz\n  w = 3\n"
    out, stopped = "", False
    for ch in text:  # one character per token
        piece, stopped = limits.feed(ch)
        out += piece
        if stopped:
            break
    # the first line is not checked; "\tz" has 1 < 4; the cut is before its first character
    assert stopped and out == "x = 1\n    y = 2\n\t"


def test_t_max_predict_ms_stops_at_the_next_newline_once_late():
    now = [0.0]
    limits = LineLimits(n_indent=0, t_max_predict_ms=100, clock=lambda: now[0])
    assert limits.feed("a\n") == ("a\n", False)  # a newline, but in time
    now[0] = 0.5
    assert limits.feed("bc") == ("bc", False)  # late, but no newline
    assert limits.feed("d\ne") == ("d\ne", True)


# -- the routes over the fake engine: the submitted ids ------------------------------------

FAKE_FIM = {"pre": 1, "suf": 2, "mid": 3, "pad": 4, "rep": 5, "sep": 6}
REPLY = "    return a * b\n    # done\nprint(1)\n"


class FimFakeTokenizer(FakeTokenizer):
    fim_ids = FAKE_FIM  # as a GGUF's metadata would name them


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(reply=REPLY)
    plain = FakeEngine()

    def factory(tokenizer):
        def make(settings, on_step) -> Backend:
            eng = engine if tokenizer is FimFakeTokenizer else plain
            return Backend(eng, tokenizer(), FakeTemplate(), "fake-coder", 2048, 4096, 0)

        return make

    coder = start_server(factory(FimFakeTokenizer))
    no_fim = start_server(factory(FakeTokenizer))
    yield coder.url, no_fim.url, engine
    coder.stop()
    no_fim.stop()


def fake_ids(prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str) -> list[int]:
    out = [5, *b"myproject\n"]
    for filename, text in extra:
        out += [6, *f"{filename}\n".encode(), *text.encode()]
    out += [6, *b"filename\n"]
    return [*out, BOS, 1, *prefix.encode(), *prompt.encode(), 2, *suffix.encode(), 3]


def test_infill_submits_the_fim_prompt_and_answers_llama_cpps_shape(fake):
    url, _, engine = fake
    body = {
        "input_prefix": "def mul(a, b):\n",
        "input_suffix": "\n\nprint(mul(2, 3))\n",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n"}, {"text": "Y = 2\n"}],
        "prompt": "    ",
        "n_predict": 200,
    }
    resp = httpx.post(f"{url}/infill", json=body)
    assert resp.status_code == 200, resp.text
    req = engine.submitted[-1]
    extra = [("util.py", "X = 1\n"), ("tmp", "Y = 2\n")]  # llama.cpp's default file name
    assert req.prompt_ids == fake_ids(body["input_prefix"], body["input_suffix"], extra, "    ")
    assert {4, 5, 6} <= req.stop_token_ids and req.max_tokens == 200
    out = resp.json()
    assert out["content"] == REPLY and out["stop"] is True and out["stop_type"] == "eos"
    assert out["tokens_evaluated"] == len(req.prompt_ids) and out["model"] == "fake-coder"
    assert out["tokens_predicted"] == len(REPLY.encode()) + 1 and out["has_new_line"] is True


def test_infill_n_indent_and_stop_words(fake):
    url = fake[0]
    body = {"input_prefix": "def mul(a, b):\n", "input_suffix": "", "n_indent": 4}
    cut = httpx.post(f"{url}/infill", json=body).json()
    assert cut["content"] == "    return a * b\n    # done\n" and cut["stop_type"] == "limit"
    word = httpx.post(f"{url}/infill", json={"input_prefix": "x", "stop": ["#"]}).json()
    assert word["content"] == "    return a * b\n    " and word["stop_type"] == "word"
    assert word["stopping_word"] == "#"
    short = httpx.post(f"{url}/infill", json={"input_prefix": "x", "n_predict": 3}).json()
    assert short["content"] == "   " and short["stop_type"] == "limit"


def finish_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        s.labels["finish_reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "cellserve_requests_total"
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_n_indent_stop_is_counted_as_a_limit_not_an_abort(fake, stream):
    """llama.cpp ends the middle there on purpose (stop_type "limit", "length" in its OpenAI
    answers, as when n_predict runs out): a normal end, not an abort."""
    url = fake[0]
    before = finish_counts(url)
    body = {"input_prefix": "def mul(a, b):\n", "n_indent": 4, "stream": stream}
    resp = httpx.post(f"{url}/infill", json=body)
    assert resp.status_code == 200 and "stop_type" in resp.text
    after = finish_counts(url)
    assert after.get("length", 0) == before.get("length", 0) + 1
    assert after.get("abort", 0) == before.get("abort", 0)


def test_infill_streams_like_completion(fake):
    url = fake[0]
    body = {"input_prefix": "def mul(a, b):\n", "n_indent": 4, "stream": True}
    resp = httpx.post(f"{url}/infill", json=body)
    lines = [ln[5:].strip() for ln in resp.text.splitlines() if ln.startswith("data:")]
    assert "[DONE]" not in lines
    chunks = [json.loads(ln) for ln in lines]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == "    return a * b\n    # done\n"
    assert chunks[-1]["stop_type"] == "limit" and chunks[-1]["content"] == ""


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded"], ids=str
)
def test_infill_reads_a_json_body_whatever_its_content_type(fake, content_type):
    """llama.cpp parses /infill's body as JSON whatever the header says (`curl -d` sends
    form-urlencoded); a body that is not JSON is a 400 in the API's error shape."""
    url = fake[0]
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"input_prefix": "def mul(a, b):\n", "n_indent": 4})
    resp = httpx.post(f"{url}/infill", content=body, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"] == "    return a * b\n    # done\n"
    for bad, code in (("input_prefix=x", "invalid_json"), ("[1, 2]", "invalid_value")):
        resp = httpx.post(f"{url}/infill", content=bad, headers=headers)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


def test_completions_suffix_is_the_same_fim_prompt(fake):
    url, _, engine = fake
    body = {"prompt": "def mul(a, b):\n", "suffix": "\nprint(1)\n", "max_tokens": 200}
    resp = httpx.post(f"{url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert engine.submitted[-1].prompt_ids == fake_ids(body["prompt"], body["suffix"], [], "")
    assert resp.json()["choices"][0]["text"] == REPLY
    ids = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [1, 2]})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"


def test_a_model_without_fim_tokens_answers_400(fake):
    url = fake[1]
    infill = httpx.post(f"{url}/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert infill.status_code == 400
    err = infill.json()["error"]
    assert err["code"] == "fim_not_supported" and "fill-in-the-middle" in err["message"]
    suffix = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert suffix.status_code == 400 and suffix.json()["error"]["param"] == "suffix"
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "suffix": ""})
    assert plain.status_code == 200  # an empty suffix is a plain completion


# -- a tiny random model with FIM tokens: the real pipeline ---------------------------------


def test_infill_and_suffix_agree_on_a_real_model(fim_folder):
    server = start_server(
        model=str(fim_folder), n_cells=512, ctx_per_seq=256, quant="none", dtype="float32"
    )
    try:
        prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
        infill = {"input_prefix": prefix, "input_suffix": suffix, "temperature": 0}
        completion = {"prompt": prefix, "suffix": suffix, "temperature": 0}
        # NOTE: the same cache state for both compared requests (test_server_live.py)
        httpx.post(f"{server.url}/infill", json={**infill, "n_predict": 1})
        a = httpx.post(f"{server.url}/infill", json={**infill, "n_predict": 8}).json()
        b = httpx.post(f"{server.url}/v1/completions", json={**completion, "max_tokens": 8})
        b = b.json()
        assert a["content"] == b["choices"][0]["text"]
        assert a["tokens_predicted"] >= 1 and a["stop_type"] in ("eos", "limit")
        assert a["tokens_evaluated"] == b["usage"]["prompt_tokens"]
        assert a["tokens_cached"] > 0  # the prefix cache holds the FIM prompt
        tok = Tokenizer.from_hf_dir(fim_folder)
        fim = fim_tokens(tok, "tiny", "input_prefix")
        expected = infill_ids(tok, fim, prefix, suffix, [], "", FimWindow(128, 256, 8))
        assert a["tokens_evaluated"] == len(expected)
    finally:
        server.stop()

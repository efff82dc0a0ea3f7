"""Loading, failed loads, a dead engine, request timeouts, protected metrics, CLI settings."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cli.main import build_settings, make_parser
from scheduler.errors import EngineDeadError
from tests.live_server import start_server
from tests.server.fake_engine import FakeEngine, fake_backend_factory


def wait_for_status(url: str, status: int, timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = httpx.get(f"{url}/health", timeout=2)
            if resp.status_code == status:
                return resp
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.02)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_health_is_503_while_loading_then_200():
    release = threading.Event()
    inner = fake_backend_factory()

    def slow_factory(settings, on_step):
        assert release.wait(10)
        return inner(settings, on_step)

    server = start_server(slow_factory, wait=False)
    try:
        assert wait_for_status(server.url, 503).json() == {"status": "loading"}
        err = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "not_ready"
        release.set()
        wait_for_status(server.url, 200)
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 200
    finally:
        release.set()
        server.stop()


def test_failed_load_keeps_health_503():
    def broken(settings, on_step):
        raise FileNotFoundError("no such model")

    server = start_server(broken, wait=False)
    try:
        assert wait_for_status(server.url, 503).json()["status"] in ("loading", "error")
        deadline = time.monotonic() + 5
        while server.app.state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"{server.url}/health").json() == {"status": "error"}
        assert "no such model" in server.app.state.load_error
    finally:
        server.stop()


class DeadEngine(FakeEngine):
    def stats(self):
        stats = super().stats()
        stats.alive = False
        return stats

    def submit(self, request):
        raise EngineDeadError("the engine thread died")


def test_dead_engine_health_and_requests_are_503():
    server = start_server(fake_backend_factory(DeadEngine()), wait=False)
    try:
        assert wait_for_status(server.url, 503).json()["status"] in ("loading", "engine_dead")
        time.sleep(0.2)
        assert httpx.get(f"{server.url}/health").json() == {"status": "engine_dead"}
        err = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "engine_dead"
    finally:
        server.stop()


def test_request_timeout_aborts_with_a_clear_error():
    engine = FakeEngine(token_delay=0.05)
    server = start_server(fake_backend_factory(engine), request_timeout=0.3)
    try:
        body = {"prompt": "x", "max_tokens": 60}
        err = error_of(httpx.post(f"{server.url}/v1/completions", json=body, timeout=10), 504)
        assert err["code"] == "request_timeout"
        resp = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=10)
        data = [ln[5:].strip() for ln in resp.text.splitlines() if ln.startswith("data:")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "request_timeout"
        deadline = time.monotonic() + 5
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.live  # both requests were aborted
    finally:
        server.stop()


def test_protect_metrics_requires_the_key():
    server = start_server(fake_backend_factory(), api_key="k", protect_metrics=True)
    try:
        error_of(httpx.get(f"{server.url}/metrics"), 401)
        ok = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and "vllm:num_requests_running" in ok.text
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("CELLSERVE_PORT", "9000")
    monkeypatch.setenv("CELLSERVE_N_CELLS", "1234")
    monkeypatch.setenv("CELLSERVE_API_KEY", "from-env")
    args = make_parser().parse_args(["serve", "--port", "9100", "--no-context-shift"])
    settings = build_settings(args)
    assert settings.port == 9100
    assert settings.n_cells == 1234
    assert settings.context_shift is False
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-env"
    assert settings.log_prompts is False


def test_bad_flag_value_is_rejected():
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--port", "not-a-number"])


def test_chat_client_streams_and_keeps_the_conversation(monkeypatch, capsys):
    from cli import chat as chat_client

    engine = FakeEngine()
    server = start_server(fake_backend_factory(engine), api_key="k")
    try:
        lines = iter(["What is the capital of France?", "And again?", ""])
        monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
        args = make_parser().parse_args(
            ["chat", "--url", server.url, "--api-key", "k", "--system", "Be brief."]
        )
        assert chat_client.run_chat(args) == 0
        out = capsys.readouterr().out
        assert out.count("The capital of France is Paris.") == 2
        second = engine.submitted[-1].prompt_ids
        text = bytes(t for t in second if t < 256).decode()
        assert "Be brief." in text and "And again?" in text
        assert text.count("The capital of France is Paris.") == 1  # the first answer is history
    finally:
        server.stop()


def test_bench_subcommand_dispatches_to_bench_cli(monkeypatch):
    import bench.cli
    from cli import main as cli

    seen = []
    monkeypatch.setattr(bench.cli, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--workload", "chat"]) == 0
    assert seen == [["--workload", "chat"]]


def test_serve_with_an_invalid_setting_exits_2(capsys):
    from cli import main as cli

    assert cli.main(["serve", "--dtype", "float8", "--n-cells", "3"]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "--n-cells" in err

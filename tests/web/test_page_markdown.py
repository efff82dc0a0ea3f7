"""Replies render as Markdown, sanitised: nothing in a model's output runs. Reasoning and tool
calls are shown apart from the answer. The real app over the fake engine (a scripted reply)."""

from __future__ import annotations

import json

import pytest
from selenium.webdriver.common.by import By

from tests.live_server import start_server
from tests.server.fake_engine import FakeEngine, fake_backend_factory
from tests.web.page import ask, last_reply, set_generation, wait_for

HOSTILE = "\n".join(
    [
        "# Title",
        "Some **bold** and *italic* and `x < y` and ~~old~~.",
        '<img src=x onerror="window.__xss = 1">',
        "<script>window.__xss = 2</script>",
        "[click](javascript:window.__xss=3) and [docs](https://example.com/a?b=1)",
        "- one",
        "- **two**",
        "",
        "```python",
        "print('<b>not bold</b>')",
        "```",
        '<a href="javascript:window.__xss=4">x</a>',
        '<iframe srcdoc="<script>parent.__xss=5</script>">',
    ]
)


@pytest.fixture
def chat_page(browser):
    servers = []

    def open_with(reply: str):
        engine = FakeEngine(reply=reply, token_delay=0.0005)
        servers.append(start_server(fake_backend_factory(engine)))
        browser.get(servers[-1].url + "/")
        wait_for(lambda: browser.find_element(By.ID, "model").get_attribute("value"), 20, "models")
        return browser

    yield open_with
    browser.get("about:blank")
    for server in servers:
        server.stop()


def reply_html(driver) -> dict:
    return driver.execute_script(
        """
        const body = [...document.querySelectorAll('.msg.assistant .msg-body')].pop();
        return {
          strong: [...body.querySelectorAll('strong')].map(e => e.textContent),
          em: [...body.querySelectorAll('em')].map(e => e.textContent),
          code: [...body.querySelectorAll('pre code')].map(e => e.textContent),
          lang: [...body.querySelectorAll('pre code')].map(e => e.className),
          inline: [...body.querySelectorAll('p code')].map(e => e.textContent),
          h1: [...body.querySelectorAll('h1')].map(e => e.textContent),
          items: [...body.querySelectorAll('li')].map(e => e.textContent),
          links: [...body.querySelectorAll('a')].map(e => e.getAttribute('href')),
          dangerous: body.querySelectorAll('img, script, iframe, [onerror], [srcdoc]').length,
          text: body.textContent,
          xss: window.__xss === undefined ? null : window.__xss,
        };
        """
    )


def test_markdown_renders_and_nothing_from_the_reply_runs(chat_page):
    page = chat_page(HOSTILE)
    set_generation(page, max_tokens=2000, ignore_eos=False)
    ask(page, "Show me some formatting.")
    done = wait_for(lambda: (r := last_reply(page)) and "done" in r["classes"] and r, 30, "reply")
    assert done["text"] == HOSTILE  # the Markdown source is kept for the history
    page.execute_script("return new Promise(r => setTimeout(r, 300))")  # any onerror would fire
    html = reply_html(page)
    assert html["xss"] is None and html["dangerous"] == 0
    assert html["strong"] == ["bold", "two"] and html["em"] == ["italic"]
    assert html["h1"] == ["Title"] and html["items"] == ["one", "two"]
    assert html["inline"] == ["x < y"]
    assert html["code"] == ["print('<b>not bold</b>')"] and html["lang"] == ["language-python"]
    assert html["links"] == ["https://example.com/a?b=1"]  # javascript: is not a link
    assert '<img src=x onerror="window.__xss = 1">' in html["text"]  # shown, as text
    assert "<script>window.__xss = 2</script>" in html["text"]


SCRIPTED_SSE_JS = """
const [chunks] = arguments;
window.fetch = async (url, options) => {
  const text = chunks.map(c => `data: ${JSON.stringify(c)}\\n\\n`).join('') + 'data: [DONE]\\n\\n';
  return new Response(text, {status: 200, headers: {'Content-Type': 'text/event-stream'}});
};
"""


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_reasoning_and_tool_calls_are_shown_apart_from_the_answer(chat_page):
    page = chat_page("unused")
    call_args = json.dumps({"city": "<b>Paris</b>"})
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants **weather**. "}),
        chunk({"reasoning_content": "<img src=x onerror=window.__xss=6>"}),
        chunk({"content": "Let me **check**."}),
        chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_weather"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": call_args[:9]}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": call_args[9:]}}]}),
        chunk({}, "tool_calls"),
    ]
    page.execute_script(SCRIPTED_SSE_JS, chunks)
    ask(page, "Weather in Paris?")
    wait_for(lambda: "done" in last_reply(page)["classes"], 20, "the reply")
    view = page.execute_script(
        """
        const msg = [...document.querySelectorAll('.msg.assistant')].pop();
        return {
          reasoning: msg.querySelector('.reasoning .reasoning-body')?.textContent,
          answer: msg.querySelector('.msg-body').textContent,
          bold: [...msg.querySelectorAll('.msg-body strong')].map(e => e.textContent),
          calls: [...msg.querySelectorAll('.tool-call')].map(e => [
            e.querySelector('.tool-call-name').textContent,
            e.querySelector('.tool-call-args').textContent]),
          dangerous: msg.querySelectorAll('img, script, b').length,
          xss: window.__xss === undefined ? null : window.__xss,
        };
        """
    )
    assert view["reasoning"] == "The user wants **weather**. <img src=x onerror=window.__xss=6>"
    assert view["answer"] == "Let me check." and view["bold"] == ["check"]
    assert view["calls"] == [["tool call: get_weather", call_args]]
    assert view["dangerous"] == 0 and view["xss"] is None

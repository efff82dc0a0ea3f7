"""Makes docs/web_page.png: the page mid-stream on SmolLM2 while other clients stream too.

python -m tests.web.screenshot [--out docs/web_page.png]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.live_server import start_server
from tests.web.conftest import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS
from tests.web.page import ask, last_reply, set_generation, table_rows, wait_for

SYSTEM = "You are a helpful assistant."
QUESTIONS = [
    "Give me three tips for writing clean Python code.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a cache is in one paragraph.",
]


def stream(url: str, question: str, max_tokens: int) -> None:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for _ in r.iter_lines():
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/web_page.png")
    args = parser.parse_args()
    server = start_server(n_cells=1024, n_seq_max=16, ctx_per_seq=256)
    profile = tempfile.mkdtemp()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        stream(server.url, "Say hello.", 8)  # leaves a prefix-cache holder behind
        threads = [
            threading.Thread(target=stream, args=(server.url, q, 120), daemon=True)
            for q in QUESTIONS[1:]
        ]
        for thread in threads:
            thread.start()
        driver.get(server.url + "/")
        wait_for(lambda: len(table_rows(driver)) >= 3, 120, "three live sequences")
        set_generation(driver, max_tokens=200, ignore_eos=False, temperature=0.3)
        driver.find_element("css selector", "details.settings summary").click()  # fold it
        ask(driver, QUESTIONS[0])
        wait_for(lambda: len(last_reply(driver)["text"]) > 160, 240, "a few lines of answer")
        time.sleep(0.3)
        driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        driver.get("about:blank")
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    main()

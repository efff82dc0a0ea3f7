"""Headless Chromium (Debian's chromium + chromium-driver) driven by Selenium.

Without chromium the browser tests skip with the reason, except under CELLSERVE_REQUIRE_TOOLS=1
(CI), where a missing tool is a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,860",
]


def missing_browser_tools() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} not found (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


def require_browser_tools() -> None:
    reason = missing_browser_tools()
    if reason is None:
        return
    if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
        pytest.fail(f"CELLSERVE_REQUIRE_TOOLS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser_session() -> Iterator[object]:
    require_browser_tools()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="cellserve-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(browser_session):
    """The shared browser, on a blank page with empty sessionStorage after each test."""
    yield browser_session
    browser_session.get("about:blank")
    browser_session.delete_all_cookies()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def fake_server():
    """start(engine, **settings) -> LiveServer over a FakeEngine; stopped at teardown."""
    from tests.web.fakes import start_fake_server

    started = []

    def start(engine, **settings):
        started.append(start_fake_server(engine, **settings))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def open_page(browser, fake_server):
    """open_page(engine, **settings) -> the browser on the page of a fake-engine server.
    The page is left (closing its streams) before the server stops."""

    def start(engine, **settings):
        server = fake_server(engine, **settings)
        browser.get(server.url)
        return browser

    yield start
    browser.get("about:blank")

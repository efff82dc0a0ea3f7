"""Without chromium the browser tests skip locally and fail under CELLSERVE_REQUIRE_TOOLS=1."""

from __future__ import annotations

import pytest

from tests.web import conftest as web_conftest


def test_missing_chromium_skips_with_the_reason(monkeypatch):
    monkeypatch.setattr(web_conftest, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("CELLSERVE_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="/nonexistent/chromium not found"):
        web_conftest.require_browser_tools()


def test_missing_chromium_fails_when_tools_are_required(monkeypatch):
    monkeypatch.setattr(web_conftest, "CHROMEDRIVER", "/nonexistent/chromedriver")
    monkeypatch.setenv("CELLSERVE_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="CELLSERVE_REQUIRE_TOOLS=1"):
        web_conftest.require_browser_tools()

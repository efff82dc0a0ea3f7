"""Behind --api-key the page asks for the key once, keeps it for the tab, and sends it."""

from __future__ import annotations

from selenium.webdriver.common.by import By

from tests.web.fakes import make_busy_engine
from tests.web.page import drawn_seqs, wait_for

KEY = "sk-test-7f3a"


def dialog_open(driver) -> bool:
    return driver.execute_script("return document.getElementById('key-dialog').open")


def enter_key(driver, key: str) -> None:
    wait_for(lambda: dialog_open(driver), timeout=10, what="the key dialog")
    driver.find_element(By.ID, "key-input").send_keys(key)
    driver.find_element(By.ID, "key-submit").click()


def test_page_asks_for_the_key_then_shows_the_map(open_page):
    engine = make_busy_engine()
    browser = open_page(engine, api_key=KEY)
    enter_key(browser, "wrong-key")
    enter_key(browser, KEY)  # a wrong key answers 401 again: the page asks again
    wait_for(lambda: drawn_seqs(browser) == {-2, 0, 1, 7}, what="the map behind the key")
    assert not dialog_open(browser)
    stored = browser.execute_script("return sessionStorage.getItem('cellserve.apiKey')")
    assert stored == KEY

    calls = engine.num_calls
    browser.refresh()  # same tab: the key is remembered, nothing is asked
    wait_for(lambda: engine.num_calls > calls and drawn_seqs(browser), what="map after reload")
    assert not dialog_open(browser)


def test_without_the_key_the_page_shows_nothing(open_page):
    engine = make_busy_engine()
    browser = open_page(engine, api_key=KEY)
    wait_for(lambda: dialog_open(browser), timeout=10, what="the key dialog")
    assert drawn_seqs(browser) == set()
    assert engine.num_calls == 0

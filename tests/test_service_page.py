"""The live page in a real browser (issue 29 item 3): headless Chromium (Debian's chromium and chromium-driver, named
explicitly: Selenium Manager would try to download a driver) loads the page of `gpucr serve --http` on simcuda with
swap apps, clicks park, and sees the app's state change and its memory bar shrink. Under CI=true it must run; elsewhere
it skips, saying what is missing. GPUCR_SCREENSHOT_DIR=DIR also saves its screenshots there (docs/service-page.png)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import test_swap
from service_api import Api
from test_swap import _until

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
WAIT_S = 20.0


def _missing() -> list[str]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e .[test])")
    return missing


@pytest.fixture
def browser(tmp_path, monkeypatch):
    missing = _missing()
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"under CI=true the browser test runs: {', '.join(missing)} missing (.ci/run installs them)")
    if missing:
        pytest.skip(f"needs headless Chromium and Selenium: {', '.join(missing)} missing "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    monkeypatch.setenv("SE_OFFLINE", "true")   # Selenium Manager never downloads anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    yield driver
    driver.quit()


@pytest.fixture
def server_args() -> list[str]:
    return ["--http", "127.0.0.1:0"]


@pytest.fixture
def gpu_of_1g(monkeypatch):
    """A simulated GPU of 1 GiB, so the apps' bars are wide enough to see and to measure."""
    monkeypatch.setenv("SIMCUDA_TOTAL_MEM", str(1 << 30))


def _until_js(driver, what: str, script: str, *args):
    return _until(what, lambda: driver.execute_script(script, *args), WAIT_S)


ROW_STATE = ("const r = document.querySelector(`tr[data-app='${arguments[0]}'] [data-role=state]`); "
             "return r && r.textContent === arguments[1]")
BAR_WIDTH = ("const s = document.querySelector(`.bar .seg[data-app='${arguments[0]}']`); "
             "const w = s ? s.getBoundingClientRect().width : 0; ")


def _save(driver, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    if os.environ.get("GPUCR_SCREENSHOT_DIR"):
        shutil.copy(tmp_path / name, Path(os.environ["GPUCR_SCREENSHOT_DIR"]) / name)


def test_the_page_parks_an_app_and_shows_its_state_and_bar_change(gpu_of_1g, swap_server, swap_app, browser, tmp_path):
    apps = {"llama-8b": swap_app("llama-8b", "--priority", "2", sizes="256M,96M"),
            "embedder": swap_app("embedder", sizes="160M"),
            "notebook": swap_app("notebook", "--idle-park", "1", sizes="96M,32M")}
    for w in apps.values():
        w.ask("work 1")
    api = Api(swap_server)
    _until("all three seen, the notebook idle-parked", lambda: len(rows := api.get("/api/v1/apps")["apps"]) == 3 and all(
        r["resident_bytes"] > 0 or r["state"] == "parked" for r in rows) and
        {r["name"]: r["state"] for r in rows}["notebook"] == "parked", WAIT_S)
    apps["notebook"].ask("work 1", timeout=30)   # its demand brings it back: a park and a resume in the timeline
    before = apps["llama-8b"].ask("digest")["digest"]

    browser.get(f"{api.url}/#token={api.token}")
    _until_js(browser, "the page shows llama-8b resident", ROW_STATE, "llama-8b", "resident")
    assert "token" not in browser.current_url, "the token leaves the address bar at once"
    wide = _until_js(browser, "llama-8b's bar is drawn", BAR_WIDTH + "return w", "llama-8b")
    assert wide > 100, wide   # 352 MiB and its context of a 1 GiB GPU, in a bar about 1200 px wide
    _until_js(browser, "the timeline shows the notebook's park and resume",
              "return document.querySelectorAll('#timeline rect').length >= 2")

    browser.find_element("css selector", "tr[data-app='llama-8b'] button[data-action=park]").click()
    _until_js(browser, "llama-8b is shown parked", ROW_STATE, "llama-8b", "parked")
    _until_js(browser, "its bar shrinks", BAR_WIDTH + "return w < arguments[1] / 4", "llama-8b", wide)
    assert api.app("llama-8b")["state"] == "parked" and api.app("embedder")["state"] == "resident"
    _save(browser, tmp_path, "service-page.png")
    _until_js(browser, "the resume button is offered",
                     "return !document.querySelector(\"tr[data-app='llama-8b'] button[data-action=resume]\").disabled")
    browser.find_element("css selector", "tr[data-app='llama-8b'] button[data-action=resume]").click()
    _until_js(browser, "llama-8b is shown resident again", ROW_STATE, "llama-8b", "resident")
    assert apps["llama-8b"].ask("digest")["digest"] == before
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors   # no script refused by the page's own CSP, no request refused

    browser.set_window_size(390, 844)   # a phone: nothing wider than the screen
    time.sleep(1.5)
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    _save(browser, tmp_path, "service-page-phone.png")


def test_the_page_without_its_token_says_what_to_do(swap_server, browser):
    api = Api(swap_server)
    browser.get(f"{api.url}/")
    msg = _until_js(browser, "the page says why it shows nothing",
                    "const m = document.getElementById('msg'); return m.style.display === 'block' && m.textContent")
    assert "wants the server's token" in msg, msg

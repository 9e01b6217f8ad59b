"""The cache dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium with the system chromedriver: no Selenium Manager, no download), against
the real processes: cache service, two workers, gateway.

The tests share one browser and one system and run in file order: the page asks for the
token, refuses a wrong one with the 401, shows the pools with a right one, and updates
without a reload after requests through the gateway; a hostile prompt stays text; the hit
rate over time fills in; a cache service that dies and comes back is shown and survived.
With ``KVSERVE_SCREENSHOT=path`` the hit-rate test also writes a screenshot of the page under
load there (docs/dashboard.png was made so).

Without Chromium the tests skip, saying what to install; ``KVSERVE_REQUIRE_BROWSER=1`` (set
by CI's ``.ci/run``, which installs it) makes that a failure instead.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from kvserve_launch.system import System
from tests.e2e.conftest import ADMIN_TOKEN, STARTUP_TIMEOUT_S, LogSink, started_system
from tests.e2e.test_faults import port, respawn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
CHROMEDRIVER = shutil.which("chromedriver")
# Polls are 2 s apart and the tree's 5 s: anything the page shows should be there by then.
UPDATE_S = 20.0
SCREENSHOT = os.environ.get("KVSERVE_SCREENSHOT", "")

# Records CSP violations and script errors from the first byte of every page load on.
RECORDER = """
window.__csp = [];
window.__errors = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
window.addEventListener('error', (e) => window.__errors.push(String(e.message)));
"""
# Exactly two blocks of 32 tokens (bytes, with this tokenizer): one tree node's preview (its
# first 64 tokens), filled by the prompt alone. (At 62 bytes its second block waited on two
# sampled tokens, and a request that stopped sooner left the text half shown: a flaky test.)
HOSTILE = '<img src=x onerror="window.__pwned=1"><b id=injected>b</b>\u202e!!!'
assert len(HOSTILE.encode()) == 64
SYSTEMS = [
    "You are the support team's terse assistant. Answer in one line, never apologize. " * 3,
    "You review code. Point out bugs only, with the line they are on, nothing else. " * 3,
]


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium; listed before the system so that a missing browser skips before
    any process starts."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        reason = (
            "no headless Chromium: install Debian's `chromium` and `chromium-driver` "
            f"(chromium: {CHROMIUM or 'missing'}, chromedriver: {CHROMEDRIVER or 'missing'})"
        )
        if os.environ.get("KVSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}; KVSERVE_REQUIRE_BROWSER=1 requires it")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--window-size=1600,1250",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    # The system chromedriver: a Service with a path skips Selenium Manager (and its download).
    # The browser gets the environment without what `kvserve_model.blas run` adds for MLX: a
    # preloaded OpenBLAS killed Chromium's renderer at start ("unable to connect to renderer").
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    try:
        driver = webdriver.Chrome(
            options=options, service=Service(executable_path=CHROMEDRIVER, env=env)
        )
    except WebDriverException as e:
        pytest.fail(f"Chromium did not start ({CHROMIUM}, {CHROMEDRIVER}): {e.msg}")
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORDER})
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def dash_system(browser: WebDriver, logs: LogSink) -> Iterator[System]:
    yield from started_system(logs)


@pytest.fixture(scope="module")
def http(dash_system: System) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{dash_system.http_address}", timeout=120) as client:
        yield client


def wait(
    driver: WebDriver, what: str, until: Callable[[WebDriver], Any], timeout_s: float = UPDATE_S
) -> Any:
    """``until``'s first truthy value within ``timeout_s``; fails naming ``what`` and the
    page's error banner (if any) otherwise."""
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(until)
    except TimeoutException:
        banner = driver.find_element(By.ID, "error").text
        raise AssertionError(f"the page never showed {what} (error banner: {banner!r})") from None


def visible(driver: WebDriver, element_id: str) -> bool:
    return driver.find_element(By.ID, element_id).is_displayed()


# The page redraws its table every poll and its tree every few seconds: an element found now
# may be replaced before it is read. Reads are scripts, one step of the page's own thread.
ROW = """
const tr = [...document.querySelectorAll('#pools tbody tr')]
  .find((r) => r.dataset.pool === arguments[0]);
return tr ? Object.fromEntries([...tr.querySelectorAll('td[data-k]')]
  .map((td) => [td.dataset.k, td.innerText])) : {};
"""


def cell(driver: WebDriver, pool: str, key: str) -> str:
    """The text of ``pool``'s cell ``key`` as the page shows it ("" while there is none)."""
    return driver.execute_script(ROW, pool).get(key, "")


def rows(driver: WebDriver) -> int:
    return driver.execute_script("return document.querySelectorAll('#pools tbody tr').length")


def click_row(driver: WebDriver, pool: str) -> None:
    """A real click on ``pool``'s row, tried again if the row was redrawn in between."""
    for _ in range(10):
        try:
            driver.find_element(By.CSS_SELECTOR, f'tr[data-pool="{pool}"]').click()
            return
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"could not click {pool}'s row")


def count(text: str) -> float:
    """A number as the page writes it (12, 1.5k, 3M); NaN for anything else (a dash), which no
    comparison accepts."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1)
    try:
        return float(text.rstrip("kMG")) * scale
    except ValueError:
        return math.nan


def tree_texts(driver: WebDriver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#tree .text')].map((e) => e.textContent)"
    )


def clean(driver: WebDriver) -> None:
    """No CSP violation and no script error since the page loaded."""
    assert driver.execute_script("return window.__csp") == []
    assert driver.execute_script("return window.__errors") == []


def complete(http: httpx.Client, prompt: str) -> str:
    """A completion through the gateway; the pool that served it."""
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.headers["x-kvserve-worker"]


def test_the_page_asks_for_the_token(browser: WebDriver, dash_system: System) -> None:
    browser.get(f"http://{dash_system.http_address}/dashboard")
    wait(browser, "the token form", lambda d: visible(d, "token-form"))
    assert not visible(browser, "main")
    assert browser.title == "kvserve · cache"
    clean(browser)


def test_a_wrong_token_shows_the_401(browser: WebDriver) -> None:
    browser.find_element(By.ID, "token-input").send_keys("not-the-token")
    browser.find_element(By.ID, "token-submit").click()
    banner = wait(
        browser, "the 401", lambda d: visible(d, "error") and d.find_element(By.ID, "error")
    )
    assert "401 Unauthorized" in banner.text and "admin token was refused" in banner.text
    assert visible(browser, "token-form") and not visible(browser, "main")
    assert browser.execute_script("return sessionStorage.length") == 0
    assert not browser.find_elements(By.CSS_SELECTOR, "#pools tbody tr")
    clean(browser)


def test_the_admin_token_shows_the_pools(browser: WebDriver) -> None:
    browser.find_element(By.ID, "token-input").send_keys(ADMIN_TOKEN)
    browser.find_element(By.ID, "token-submit").click()
    wait(browser, "both pools", lambda d: rows(d) == 2)
    assert not visible(browser, "error") and not visible(browser, "token-form")
    for pool in ("worker-0", "worker-1"):
        row = browser.execute_script(ROW, pool)  # one poll's numbers
        blocks = [count(row[k]) for k in ("free", "cached", "referenced")]
        assert sum(blocks) == 256, (pool, blocks)  # the launch config's --num-blocks
        assert "/ 256 used" in row["occupancy"] and " tok/block" in row["occupancy"]
        # The pool's memory, from the bytes a block holds that the worker registered.
        assert re.search(r"[\d.]+ (B|KiB|MiB) / [\d.]+ MiB · ", row["occupancy"]), row["occupancy"]
        assert row["pool"].startswith(pool) and row["hit-tok"].endswith("%")
    assert browser.find_element(By.ID, "t-pools").text == "2 / 2"
    # The token stays in this tab's storage and headers: never in the address.
    assert browser.execute_script("return sessionStorage.getItem('kvserve.adminToken')") == (
        ADMIN_TOKEN
    )
    assert ADMIN_TOKEN not in browser.current_url
    clean(browser)


def test_the_page_updates_after_a_request(browser: WebDriver, http: httpx.Client) -> None:
    browser.execute_script("window.__same_page = true")  # gone if the page reloads
    pools = ("worker-0", "worker-1")
    before = {p: count(cell(browser, p, "acquires")) for p in pools}
    cached = {p: count(cell(browser, p, "cached")) for p in pools}
    prompt = "The dashboard watches this prompt being cached, block by block, in real time."
    pool = complete(http, prompt)

    wait(
        browser,
        f"{pool}'s acquires grow",
        lambda d: count(cell(d, pool, "acquires")) > before[pool],
    )
    wait(browser, "more cached blocks", lambda d: count(cell(d, pool, "cached")) > cached[pool])
    click_row(browser, pool)
    wait(browser, "the prompt in the tree", lambda d: any(prompt[:40] in t for t in tree_texts(d)))
    assert browser.find_element(By.ID, "tree-pool").get_attribute("value") == pool
    assert browser.execute_script("return window.__same_page") is True
    assert "tokens indexed" in browser.find_element(By.ID, "tree-summary").text
    clean(browser)


def test_hostile_text_in_the_tree_stays_text(browser: WebDriver, http: httpx.Client) -> None:
    pool = complete(http, HOSTILE)
    select = browser.find_element(By.ID, "tree-pool")
    browser.execute_script(
        "arguments[0].value = arguments[1];arguments[0].dispatchEvent(new Event('change'))",
        select,
        pool,
    )
    shown = wait(
        browser,
        "the hostile prompt as text",
        lambda d: next(
            (t for t in tree_texts(d) if '<img src=x onerror="window.__pwned=1">' in t), None
        ),
    )
    assert "<b id=injected>b</b>" in shown
    assert "\u202e" not in shown  # a bidi override is shown as U+FFFD, not obeyed
    assert browser.execute_script("return window.__pwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#tree img, #tree script, #injected")
    clean(browser)


def test_hit_rates_fill_in_over_time(browser: WebDriver, http: httpx.Client) -> None:
    """Chats sharing system prompts for a while: the last minute's hit rate is computed
    by the page from the counters of consecutive polls, and the charts are drawn."""
    with traffic(http, seconds=8.0):
        pass
    hit = (
        wait(
            browser, "a hit rate", lambda d: d.find_element(By.ID, "t-hit").text.endswith("%") and d
        )
        .find_element(By.ID, "t-hit")
        .text
    )
    assert 0 < float(hit.rstrip("%")) <= 100, hit
    painted = browser.execute_script(
        "const c = document.getElementById('c-tokens');"
        "const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < px.length; i += 4) if (px[i]) n++; return n"
    )
    assert painted > 1000  # bars, not only the grid and its labels
    clean(browser)
    if not SCREENSHOT:
        return
    # The picture for the docs: a pinned system prompt (on the pools holding it), the tree of
    # the pool with the most pinned, and the page under load long enough to fill the charts.
    pinned = {}
    for pool in ("worker-0", "worker-1"):
        body = {"pool": pool, "messages": [{"role": "system", "content": SYSTEMS[0]}]}
        r = http.post(
            "/admin/cache/pin", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        pinned[pool] = r.json().get("blocks", 0) if r.status_code == 200 else 0
    click_row(browser, max(pinned, key=lambda p: pinned[p]))
    with traffic(http, seconds=50.0, clients=3):
        time.sleep(45.0)
        assert browser.save_screenshot(SCREENSHOT), SCREENSHOT


def test_a_cache_service_restart_is_shown_and_survived(
    browser: WebDriver, dash_system: System, http: httpx.Client
) -> None:
    """The cache service killed: the page says so, keeps the last numbers (marked stale) and
    retries. Restarted on its port, the workers register again (new incarnations, counters
    from 0) and the page carries on without a reload, no rate negative."""
    browser.execute_script("window.__same_page = true")
    old = dash_system.cache
    old.kill()
    banner = wait(
        browser,
        "the outage",
        lambda d: (
            "retrying" in d.find_element(By.ID, "error").text and d.find_element(By.ID, "error")
        ),
    )
    assert banner.is_displayed() and banner.text.startswith("HTTP 503"), banner.text
    assert visible(browser, "main") and rows(browser) == 2
    wait(
        browser,
        "the stale mark",
        lambda d: "stale" in d.find_element(By.ID, "updated").get_attribute("class"),
    )

    dash_system.cache = respawn(old, **{"--port": port(dash_system.cache_address)})
    dash_system.cache.wait_ready(STARTUP_TIMEOUT_S)
    wait(
        browser,
        "both pools registered again",
        lambda d: not visible(d, "error") and rows(d) == 2,
        timeout_s=90.0,
    )
    pool = complete(http, "After the restart, the counters start again from zero.")
    wait(browser, "the new acquire", lambda d: count(cell(d, pool, "acquires")) >= 1)
    assert "stale" not in browser.find_element(By.ID, "updated").get_attribute("class")
    for tile in ("t-hit", "t-tps", "t-evict", "t-leases"):
        assert not browser.find_element(By.ID, tile).text.startswith(("-", "\u2212")), tile
    assert browser.execute_script("return window.__same_page") is True
    clean(browser)


class traffic:
    """``clients`` sending chats (two system prompts, many questions) for ``seconds``."""

    def __init__(self, http: httpx.Client, seconds: float, clients: int = 2) -> None:
        self.http = http
        self.until = time.monotonic() + seconds
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]
        self.errors: list[str] = []

    def _client(self, i: int) -> None:
        n = 0
        while time.monotonic() < self.until:
            n += 1
            messages = [
                {"role": "system", "content": SYSTEMS[n % 2]},
                {"role": "user", "content": f"Question {i}.{n}: where did block {n} go?"},
            ]
            r = self.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
            if r.status_code != 200:
                self.errors.append(r.text)

    def __enter__(self) -> traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors[:3]

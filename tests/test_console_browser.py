"""The console in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
installed by the Makefile), driven by Selenium, after real traffic through a relay
subprocess: a tool session whose ids the upstream reuses (dedup rewrites them), a history
the relay refuses, an upstream 400 that leaves a dump. Each step saves a screenshot into
the test's temporary directory."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from support import backend

pytestmark = pytest.mark.slow
# Every page the test visits is also checked for accessibility (Console.shot).

ADMIN = "browser-admin-key-0123456789"
CLIENT = "browser-client-key-0123456789"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
AXE = Path(__file__).resolve().parent.parent / ".axe" / "node_modules" / "axe-core" / "axe.min.js"
# What axe-core finds on a page and may not be: its two worst impacts.
SERIOUS = ("serious", "critical")
SESSION = "browser-test-session"


def send(url: str, body: dict, key: str = CLIENT) -> tuple[int, dict, str]:
    """The status, body and request id of one Messages request."""
    call = urllib.request.Request(url + "/v1/messages", data=json.dumps(body).encode(),
                                  method="POST", headers={"content-type": "application/json",
                                                          "x-api-key": key})
    try:
        with urllib.request.urlopen(call, timeout=20) as response:
            return (response.status, json.loads(response.read()),
                    response.headers["x-relay-request-id"])
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers["x-relay-request-id"]


def post(url: str, body: dict, key: str = CLIENT) -> tuple[int, dict]:
    status, answer, _ = send(url, body, key)
    return status, answer


def tool_session(url: str) -> int:
    """A tool loop of one session as an agent drives it; returns its turns."""
    messages: list[dict] = [{"role": "user", "content": "Run the tool until you are done."}]
    tools = [{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}}}]
    for turn in range(1, 10):
        status, message = post(url, {"model": "claude-test", "max_tokens": 100, "tools": tools,
                                     "metadata": {"user_id": SESSION}, "messages": messages})
        assert status == 200, message
        messages.append({"role": "assistant", "content": message["content"]})
        calls = [b for b in message["content"] if b["type"] == "tool_use"]
        if not calls:
            return turn
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c["id"], "content": "ok"} for c in calls]})
    raise AssertionError("the session did not end")


def cached_session(url: str) -> None:
    """Two turns of another session with a cached system prompt, the second with that prompt
    changed: a cache break whose cause is the system's."""
    marker = {"type": "ephemeral"}
    for turn, rule in enumerate(("Be terse.", "Be verbose.")):
        messages = [{"role": "user" if n % 2 == 0 else "assistant",
                     "content": [{"type": "text", "text": f"message {n} " * 30}]}
                    for n in range(2 * turn + 1)]
        messages[-1]["content"][0]["cache_control"] = marker
        status, answer = post(url, {
            "model": "claude-test", "max_tokens": 100, "metadata": {"user_id": "cached"},
            "system": [{"type": "text", "text": "You are a coding agent. " * 20},
                       {"type": "text", "text": rule, "cache_control": marker}],
            "messages": messages})
        assert status == 200, answer


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000",
                     f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture
def stack(emulator, relay, tmp_path):
    tools = emulator("--tool-turns", "3", "--reuse-ids", "--prompt-cache")
    strict = emulator("--expect-own-ids")
    r = relay({"server": {"console": True, "auth": {
                   "keys": [{"name": "team-a", "key_env": "CLIENT_KEY"}],
                   "admin_key_env": "ADMIN_KEY"}},
               "pipeline": ["limits", "usage", "cache", "dedup", "pairing", "dump"],
               "plugins": {"dump": {"dir": str(tmp_path / "dumps")}},
               "backends": [backend(tools.url, "tools", models=["claude-*"]),
                            backend(strict.url, "strict", models=["strict-*"])]},
              env={"CLIENT_KEY": CLIENT, "ADMIN_KEY": ADMIN})
    return r


class Console:
    """The browser on the console, saving a screenshot of each page it is asked to."""

    def __init__(self, driver, url: str, shots: Path):
        self.driver, self.url, self.shots = driver, url, shots
        shots.mkdir(exist_ok=True)

    def open(self, path: str) -> None:
        self.driver.get(self.url + path)

    def text(self) -> str:
        return self.driver.find_element(By.TAG_NAME, "body").text

    def shot(self, name: str) -> None:
        """Save a screenshot of the page, and check it with axe-core: no serious or critical
        accessibility violation."""
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))
        # The page runs no script of its own (its policy allows none); the driver's may.
        self.driver.execute_script(AXE.read_text(encoding="utf-8"))
        found = self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "axe.run(document, {resultTypes: ['violations']}).then(r => done(r.violations.map("
            "v => ({id: v.id, impact: v.impact, help: v.help, where: v.nodes.map("
            "n => n.target.join(' ')).slice(0, 3)})))).catch(e => done(String(e)));")
        assert isinstance(found, list), found
        assert not [v for v in found if v["impact"] in SERIOUS], (name, found)

    def log_in(self, key: str) -> None:
        self.open("/console/login")
        self.driver.find_element(By.ID, "key").send_keys(key)
        self.click("form.login button")

    def click(self, selector: str, within=None) -> None:
        """Click, and wait for the page it leads to (a form's answer arrives after the click
        returns)."""
        page = self.driver.find_element(By.TAG_NAME, "html")
        (within or self.driver).find_element(By.CSS_SELECTOR, selector).click()
        WebDriverWait(self.driver, 10).until(replaced(page))


def replaced(page):
    """A wait condition: the page whose ``html`` element is ``page`` has been replaced.
    Asked while Chromium swaps the documents, ChromeDriver can answer with a generic error
    for a node of the old one ("does not belong to the document") instead of a stale
    element: that is the old page gone too."""
    def gone(driver) -> bool:
        try:
            page.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as e:
            if "does not belong to the document" in str(e):
                return True
            raise
        return False
    return gone


def wait_for(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_the_console_shows_real_traffic_and_keeps_strangers_out(stack, browser, tmp_path):
    url = stack.url
    turns = tool_session(url)
    assert turns == 4
    # A history the relay refuses: a result for a call that is nowhere.
    status, refused, refused_id = send(url, {"model": "claude-test", "max_tokens": 10,
                                             "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nowhere",
                                      "content": "x"}]}]})
    assert status == 400 and refused["error"]["type"] == "invalid_request_error"
    # In the same session, the strict upstream refuses a call id it never issued, naming the
    # block: a dump.
    status, failed, failed_id = send(url, {
        "model": "strict-model", "max_tokens": 10, "metadata": {"user_id": SESSION},
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_foreign",
                                               "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_foreign",
                                          "content": "x"}]}]})
    assert status == 400 and "messages.1.content.0" in failed["error"]["message"]
    cached_session(url)

    console = Console(browser, url, tmp_path / "screenshots")
    console.log_in(CLIENT)
    assert "relay key" in console.text() and "Log in" in browser.title
    assert not any(c["name"] == "relay_console" for c in browser.get_cookies())
    console.shot("login-refused")

    console.log_in(ADMIN)
    assert browser.current_url == url + "/console" and CLIENT not in browser.current_url
    cookie = next(c for c in browser.get_cookies() if c["name"] == "relay_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and ADMIN not in cookie["value"]

    def metric(name: str) -> float:
        shown = browser.find_element(By.CSS_SELECTOR, f"[data-metric='{name}']").text
        return float(shown.strip("$").replace(",", ""))

    assert metric("requests-hour") == turns + 4 and metric("errors-hour") == 2
    # dedup's: the answers of turns 2 and 3 reuse the first call's id, rewritten for the
    # client, and the ids restored on their way back up.
    assert metric("repairs-hour") >= 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.chart")) >= 8
    console.shot("overview")

    # The refused history, by its outcome.
    console.open("/console/exchanges?outcome=rejected")
    assert refused_id in console.text() and failed_id not in console.text()
    console.open("/console/exchanges")
    assert failed_id in console.text() and refused_id in console.text()
    console.shot("exchanges")

    # The cache break, with its cause, in its session; from the tool session to its
    # exchange, to the exchange's dump.
    console.open("/console/sessions")
    rows = browser.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert sum("system_changed" in row.text for row in rows) == 1
    session_row = next(row for row in rows if "strict" in row.text)
    cells = [cell.text for cell in session_row.find_elements(By.TAG_NAME, "td")]
    assert cells[2] == str(turns + 1)  # its turns and the strict request
    assert "tools" in cells[3] and "strict" in cells[3] and int(cells[6]) >= 2
    console.shot("sessions")
    console.click("a[href^='/console/session?id=']", within=session_row)
    assert failed_id in console.text()
    console.shot("session")
    rewritten_id = next(
        cells[0].text for cells in (row.find_elements(By.TAG_NAME, "td")
                                    for row in browser.find_elements(By.CSS_SELECTOR, "tbody tr"))
        if cells[9].text != "0")  # its id rewrites
    console.click(f"a[href='/console/exchange?id={rewritten_id}']")
    assert "rewrote" in browser.find_element(By.CSS_SELECTOR, "svg.sequence").text
    browser.back()
    console.click(f"a[href='/console/exchange?id={failed_id}']")
    sequence = browser.find_element(By.CSS_SELECTOR, "svg.sequence").text
    assert "strict" in sequence and "400" in sequence
    console.shot("exchange")
    # The dump is written in the background: it may take a moment to appear.
    assert wait_for(lambda: browser.refresh() or browser.find_elements(
        By.CSS_SELECTOR, "a[href^='/console/dump?name=']"))
    console.click("a[href^='/console/dump?name=']")
    offending = browser.find_element(By.ID, "offending")
    assert "toolu_foreign" in offending.text and "messages.1.content.0" in offending.text
    assert "offending" in offending.get_attribute("class")
    assert "unknown `tool_use` id toolu_foreign" in browser.find_element(
        By.ID, "error-message").text
    assert "identical to the dumped one" in console.text()
    columns = browser.find_elements(By.CSS_SELECTOR, ".diff pre")
    assert len(columns) == 2
    assert "toolu_foreign" in columns[0].text and "toolu_foreign" in columns[1].text
    console.shot("dump")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", offending)
    console.shot("dump-block")
    console.open("/console/dumps")
    assert failed_id in console.text()
    console.shot("dumps")

    console.open("/console/backends")
    assert "tools" in console.text() and "strict" in console.text()
    console.shot("backends")

    # A key made in the console works until it is revoked there.
    console.open("/console/keys")
    browser.find_element(By.ID, "new-name").send_keys("team-b")
    browser.find_element(By.ID, "new-limits").send_keys('{"requests_per_minute": 60}')
    console.click("form[action='/console/keys/create'] button")
    secret = browser.find_element(By.ID, "new-secret").text
    assert secret.startswith("sk-relay-")
    assert wait_for(lambda: post(url, {"model": "claude-test", "max_tokens": 10, "messages": [
        {"role": "user", "content": "hi"}]}, key=secret)[0] == 200)
    console.open("/console/keys")
    assert secret not in console.text()
    console.shot("keys")
    console.click("button[aria-label='revoke team-b']")
    assert browser.current_url == url + "/console/keys" and "revoked" in console.text()
    assert wait_for(lambda: post(url, {"model": "claude-test", "max_tokens": 10, "messages": [
        {"role": "user", "content": "hi"}]}, key=secret)[0] == 401)

    # An action from a form without its token: refused, and the session goes on.
    console.open("/console")
    page = browser.find_element(By.TAG_NAME, "html")
    # The page runs no script (its policy says so); the driver's own may still edit it.
    browser.execute_script("const f = document.querySelector('header form');"
                           "f.querySelector('input[name=csrf]').remove(); f.submit();")
    WebDriverWait(browser, 10).until(replaced(page))
    assert "CSRF" in console.text()
    console.open("/console")
    assert "Overview" in browser.title

    console.click("header form button")
    assert browser.current_url == url + "/console/login"
    console.open("/console/sessions")
    assert browser.current_url == url + "/console/login"

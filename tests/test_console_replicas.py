"""The console on two replicas sharing one state (SQLite) and one dump directory: a login on
one is a login on the other, each shows what the other served, and a logout on one ends the
session on both."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
from support import backend

pytestmark = pytest.mark.slow

ADMIN = "replica-admin-key-0123456789"
CLIENT = "replica-client-key-0123456789"
CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def fetch(url: str, cookie: str = "", form: dict | None = None, body: dict | None = None,
          key: str | None = None):
    """status, headers, text of one request (redirects are not followed)."""
    headers = {"Cookie": cookie} if cookie else {}
    data = None
    if form is not None:
        data = "&".join(f"{k}={urllib.request.quote(v)}" for k, v in form.items()).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if body is not None:
        data = json.dumps(body).encode()
        headers.update({"Content-Type": "application/json", "x-api-key": key or CLIENT})
    call = urllib.request.Request(url, data=data, headers=headers,
                                  method="POST" if data is not None else "GET")
    try:
        with OPENER.open(call, timeout=20) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def cookie_of(headers, name: str) -> str:
    for value in headers.get_all("Set-Cookie") or ():
        if value.startswith(name + "="):
            return value.split(";", 1)[0]
    raise AssertionError(f"no {name} cookie")


def log_in(url: str) -> str:
    _, headers, page = fetch(url + "/console/login")
    status, headers, _ = fetch(url + "/console/login", cookie_of(headers, "relay_console_login"),
                               form={"csrf": CSRF.search(page).group(1), "key": ADMIN})
    assert status == 303
    return cookie_of(headers, "relay_console")


def test_two_replicas_share_the_console(emulator, relay, tmp_path):
    upstream = emulator()
    config = {"server": {"console": True, "auth": {
                  "keys": [{"name": "team-a", "key_env": "CLIENT_KEY"}],
                  "admin_key_env": "ADMIN_KEY"}},
              "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
              "pipeline": ["usage", "dump"],
              "plugins": {"dump": {"dir": str(tmp_path / "dumps")}},
              "backends": [backend(upstream.url)]}
    env = {"CLIENT_KEY": CLIENT, "ADMIN_KEY": ADMIN}
    one, two = relay(config, env=env), relay(config, env=env)
    status, headers, _ = fetch(two.url + "/v1/messages", body={
        "model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    served = headers["x-relay-request-id"]

    cookie = log_in(one.url)
    status, _, page = fetch(two.url + "/console/exchanges", cookie)
    assert status == 200 and served in page  # logged in at one, seen at two
    status, _, page = fetch(one.url + "/console/exchanges", cookie)
    assert served in page  # what two served, on one's page

    token = CSRF.search(page).group(1)
    status, _, _ = fetch(one.url + "/console/logout", cookie, form={"csrf": token})
    assert status == 303
    for url in (one.url, two.url):
        status, headers, _ = fetch(url + "/console/exchanges", cookie)
        assert status == 303 and headers["Location"] == "/console/login"

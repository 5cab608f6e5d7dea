"""Which proxy a backend is reached through (relay.egress): ``proxy:``, the environment's
variables and ``NO_PROXY`` as curl and urllib read them, and a malformed one refused by name
without its password. The traffic itself goes through a real proxy in test_proxy.py."""

from __future__ import annotations

import pytest
import yaml

from relay import cli
from relay import config as config_module
from relay.egress import bypassed
from relay.errors import ConfigError

PASSWORD = "proxy-pass-7f3e9a1c5b"


def proxy_of(url: str, env: dict, **extra):
    raw = {"backends": [{"name": "up", "url": url, "models": ["*"], **extra}]}
    return config_module.parse(raw, env).backends[0].proxy


@pytest.mark.parametrize("host,port,no_proxy,direct", [
    ("api.example.com", 443, "example.com", True),
    ("example.com", 443, ".example.com", True),
    ("api.example.com", 443, "*.example.com", True),
    ("API.Example.com.", 443, "example.COM", True),
    ("notexample.com", 443, "example.com", False),
    ("example.com.evil", 443, "example.com", False),
    ("a.b", 443, "*", True),
    ("a.b", 443, "c.d *", True),             # white space separates too
    ("a.b", 443, " c.d , a.b ", True),
    ("a.b", 443, "", False),
    ("h.corp", 8080, "h.corp:8080", True),
    ("h.corp", 443, "h.corp:8080", False),
    ("127.0.0.1", 80, "127.0.0.1", True),
    ("127.0.0.1", 80, "localhost", False),    # loopback is not exempt by itself
    ("10.1.2.3", 443, "10.0.0.0/8", True),
    ("10.1.2.3", 443, "0.0.0.0/0,::/0", True),
    ("11.1.2.3", 443, "10.0.0.0/8", False),
    ("127.0.0.1", 80, "0.1", False),          # names never match an address by suffix
    ("::1", 80, "::1", True),
    ("::1", 80, "[::1]:80", True),
    ("::1", 81, "[::1]:80", False),
    ("2001:db8::5", 443, "2001:db8::/32", True),
    ("a.b", 443, "a.b:port", False),
])
def test_no_proxy_matches_as_curl_and_urllib_do(host, port, no_proxy, direct):
    assert bypassed(host, port, no_proxy) is direct


def test_the_environment_names_each_schemes_proxy_lowercase_first():
    env = {"HTTPS_PROXY": "http://upper:3128", "https_proxy": "http://lower:3128",
           "HTTP_PROXY": "plain.corp:8080"}
    proxy = proxy_of("https://api.anthropic.com", env)
    assert (proxy.url, proxy.source) == ("http://lower:3128", "https_proxy")
    proxy = proxy_of("http://10.0.0.5:8000/v1", env)  # no scheme: an http:// proxy
    assert (proxy.url, proxy.source) == ("http://plain.corp:8080", "HTTP_PROXY")
    assert proxy_of("https://api.anthropic.com", {"HTTP_PROXY": "http://p:1"}) is None
    assert proxy_of("https://api.anthropic.com", {"https_proxy": ""}) is None
    assert proxy_of("https://api.anthropic.com",
                    {**env, "no_proxy": "anthropic.com", "NO_PROXY": ""}) is None
    assert proxy_of("https://api.anthropic.com", env, proxy="none") is None
    assert proxy_of("https://api.anthropic.com", env, proxy=None) is None


def test_a_proxys_credentials_make_its_header_and_stay_out_of_its_record():
    proxy = proxy_of("https://api.anthropic.com", {},
                     proxy=f"https://relay%40corp:{PASSWORD}@[::1]:8443")
    assert proxy.url == "https://[::1]:8443"
    assert proxy.authorization == "Basic cmVsYXlAY29ycDpwcm94eS1wYXNzLTdmM2U5YTFjNWI="
    assert PASSWORD not in repr(proxy) and "Basic" not in repr(proxy)
    assert proxy_of("https://x.y", {}, proxy="http://p.corp").url == "http://p.corp:80"


@pytest.mark.parametrize("value,words", [
    (f"socks5://user:{PASSWORD}@p:1080", "backends[0].proxy: the proxy must be an http:// or "
     "https:// URL, not socks5:// (or none to go direct)"),
    (f"user:{PASSWORD}@p:3128", "backends[0].proxy: the proxy must be an http:// or https:// "
     "URL, not user:// (or none to go direct)"),
    (f"http://user:{PASSWORD}", "backends[0].proxy: not a valid proxy URL: a port that is not "
     "a number from 0 to 65535, or a broken [IPv6] address (or none to go direct)"),
    (f"http://user:{PASSWORD}@p:3128/path", "backends[0].proxy: a proxy URL is "
     "scheme://[user:password@]host[:port], without a path, query or fragment (or none to go "
     "direct)"),
    ("http://:3128", "backends[0].proxy: the proxy URL has no host (or none to go direct)"),
    (3128, "backends[0].proxy: must be a proxy URL (http:// or https://) or none"),
])
def test_a_malformed_proxy_is_refused_by_name_without_its_password(value, words):
    with pytest.raises(ConfigError) as refused:
        proxy_of("https://api.anthropic.com", {}, proxy=value)
    assert str(refused.value) == words


def test_a_malformed_environment_proxy_names_the_variable_and_the_way_out():
    with pytest.raises(ConfigError) as refused:
        proxy_of("https://api.anthropic.com", {"HTTPS_PROXY": f"socks5h://u:{PASSWORD}@p:1"})
    assert str(refused.value) == ("backends[0]: HTTPS_PROXY: the proxy must be an http:// or "
                                  "https:// URL, not socks5h:// (set backends[0].proxy: none to "
                                  "go direct)")


def test_relay_validate_refuses_a_malformed_proxy(tmp_path, capsys):
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"backends": [
        {"name": "up", "url": "https://api.anthropic.com", "models": ["*"],
         "proxy": f"http://user:{PASSWORD}@proxy.corp:31 28"}]}))
    request = tmp_path / "request.json"
    request.write_text('{"model": "m", "max_tokens": 1, "messages": []}')
    assert cli.main(["validate", str(request), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "backends[0].proxy: not a valid proxy URL" in err and PASSWORD not in err


def test_the_start_up_line_names_the_proxy_without_its_credentials():
    raw = {"backends": [
        {"name": "up", "url": "https://api.anthropic.com", "models": ["*"]},
        {"name": "local", "url": "http://127.0.0.1:8000", "models": ["q*"]}]}
    config = config_module.parse(raw, {"HTTPS_PROXY": f"http://u:{PASSWORD}@proxy.corp:3128",
                                       "HTTP_PROXY": "http://proxy.corp:3128",
                                       "NO_PROXY": "127.0.0.1"})
    line = cli.describe(config)
    assert "up https://api.anthropic.com (*, via proxy http://proxy.corp:3128 from " \
           "HTTPS_PROXY)" in line
    assert "local http://127.0.0.1:8000 (q*)" in line and PASSWORD not in line

"""What the distribution promises: its licence, its command line, its make targets."""

from __future__ import annotations

import configparser
import subprocess
import sys

import pytest
from support import ROOT


def relay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_licence_file_is_the_declared_one():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["metadata"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_runtime_packages_hold_code_py_typed_and_the_console_only():
    # The evidence tables are test and docs data (docs/evidence/): nothing at run time reads
    # them, so they stay out of what is installed. The console's page template and
    # stylesheet are what it serves, declared as package data so that they install.
    shipped = sorted(path.relative_to(ROOT).as_posix()
                     for package in ("relay", "plugins") for path in (ROOT / package).rglob("*")
                     if path.is_file() and "__pycache__" not in path.parts
                     and path.suffix != ".py")
    console = [name for name in shipped if name.startswith("relay/console/")]
    assert [name for name in shipped if name not in console] == ["relay/py.typed"]
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    patterns = setup["options.package_data"]["relay.console"].replace(",", " ").split()
    assert sorted(console) == sorted(
        path.relative_to(ROOT).as_posix() for pattern in patterns
        for path in (ROOT / "relay" / "console").glob(pattern))
    assert "relay.console" in setup["options"]["packages"]
    assert sorted(p.name for p in (ROOT / "docs" / "evidence").iterdir()) == [
        "betas.json", "cache.json", "inbound.json", "rules.json"]


@pytest.mark.slow
def test_an_unknown_command_is_an_invalid_choice():
    done = relay("frobnicate")
    assert done.returncode == 2
    assert "invalid choice: 'frobnicate'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_top_level_help_names_the_config_option():
    done = relay("--help")
    assert done.returncode == 0 and "--config" in done.stdout and "serve" in done.stdout


@pytest.mark.slow
def test_make_clean_never_deletes_dumps(tmp_path):
    done = subprocess.run(["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and "rm -rf" in done.stdout
    removed = done.stdout.split("rm -rf", 1)[1].split()
    assert "dumps" not in removed and not any("dump" in path for path in removed)


def test_make_try_puts_the_relay_in_front_of_the_emulator_on_loopback():
    import re

    import yaml

    from relay import config as config_module
    config = config_module.parse(yaml.safe_load((ROOT / "examples" / "try.yaml").read_text()), {})
    recipe = (ROOT / "Makefile").read_text().split("\ntry:", 1)[1].split("\n\n", 1)[0]
    port = re.search(r"relay emulate --port (\d+)", recipe).group(1)
    assert config.host == "127.0.0.1" and config.keys is None
    assert config.backends[0].url == f"http://127.0.0.1:{port}" and config.backends[0].default
    assert "examples/try.yaml" in recipe


def test_the_minimum_versions_run_are_the_declared_floors():
    import re
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    floors = dict(re.match(r"([\w-]+)>=([\d.]+)(?:,<[\d.]+)?$", line.strip()).groups()
                  for line in setup["options"]["install_requires"].strip().splitlines())
    pins = re.search(r"^MIN_PINS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert dict(pin.split("==") for pin in pins.split()) == floors


def test_start_up_says_what_it_loaded(relay, emulator):
    from support import backend
    emu = emulator()
    server = relay({"pipeline": ["dedup", "pairing"], "backends": [backend(emu.url, default=True)]})
    first = server.output().splitlines()[0]
    assert first.startswith("relay: config ") and "relay.yaml; pipeline [dedup, pairing]" in first
    assert f"backends: emu {emu.url} (*, default)" in first and "inbound auth off" in first

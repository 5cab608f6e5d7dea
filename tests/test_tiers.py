"""The tiers hold: a test outside ``slow`` and ``e2e`` cannot start a process (conftest.py
refuses it), and ``make check`` selects exactly the tier setup.cfg declares."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys

import pytest
import yaml
from support import ROOT


def test_a_fast_test_cannot_start_a_process():
    with pytest.raises(AssertionError, match="outside the slow tier: mark it"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match="outside the slow tier"):
        os.fork()


def test_asking_for_a_process_fixture_is_the_slow_tier(request, emulator, relay):
    # Not started: the fixtures hand out starters, so this stays cheap.
    assert request.node.get_closest_marker("slow") is not None


@pytest.mark.slow
def test_the_slow_tier_may_start_one():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_make_check_runs_the_fast_tier_of_the_declared_markers():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    declared = {line.split(":")[0].strip()
                for line in parser["tool:pytest"]["markers"].splitlines() if line.strip()}
    assert {"slow", "e2e"} <= declared
    makefile = (ROOT / "Makefile").read_text()
    fast = re.search(r"^FAST_TIER := (.+)$", makefile, re.M)
    assert fast is not None and fast.group(1) == '-m "not e2e and not slow" -n 2'
    check = re.search(r"^check:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert check is not None and "$(FAST_TIER)" in check.group(1)


def test_the_commit_hooks_are_local_and_run_the_same_tier():
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in hooks["repos"]] == ["local"]
    entries = {hook["id"]: hook for repo in hooks["repos"] for hook in repo["hooks"]}
    assert {hook["language"] for hook in entries.values()} == {"system"}
    assert entries["fast-tests"]["entry"].endswith('pytest -q -m "not e2e and not slow" -n 2')

"""The tiers hold: a test outside ``slow`` and ``e2e`` cannot start a process (conftest.py
refuses it), and ``make check`` selects exactly the tier setup.cfg declares."""

from __future__ import annotations

import ast
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


def test_no_module_names_a_fixture_of_its_own_after_a_process_fixture():
    # The tier is chosen by the fixture's name: a module's own in-process `relay` would put
    # its tests in the slow tier, never run by `make check`.
    from conftest import PROCESS_FIXTURES
    shadowing = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "conftest.py" and path.parent == ROOT / "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name in PROCESS_FIXTURES and any(
                        "fixture" in ast.unparse(d) for d in node.decorator_list):
                shadowing.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert shadowing == []


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

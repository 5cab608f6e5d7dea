"""`make demo` keeps telling the truth: directly the session dies, through the relay it completes."""

import subprocess
import sys

import pytest
from support import ROOT

pytestmark = pytest.mark.e2e


def test_demo_session_fails_directly_and_completes_through_the_relay():
    proc = subprocess.run([sys.executable, "-m", "relay.demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "`tool_use` ids must be unique" in proc.stdout
    assert "-5)" in proc.stdout
    assert "direct: FAILED; through the relay: completed" in proc.stdout

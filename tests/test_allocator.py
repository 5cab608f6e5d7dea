"""``server.keep_freed_bytes``: freed memory kept for reuse, so that large request bodies do
not fault in fresh pages each time (relay.allocator)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from relay import allocator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "bench"))
import workloads  # noqa: E402

MIB = 1024 * 1024
linux = pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")


class FakeLibc:
    def __init__(self, answer: int = 1):
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.answer


def test_the_limit_sets_both_thresholds():
    libc = FakeLibc()
    said = allocator.keep_freed(64 * MIB, environ={}, libc=libc)
    assert libc.calls == [(allocator.M_MMAP_THRESHOLD, 32 * MIB),
                          (allocator.M_TRIM_THRESHOLD, 64 * MIB)]
    assert said == (True, f"up to {64 * MIB} bytes of freed memory kept for reuse")


def test_a_small_limit_keeps_the_mmap_threshold_at_its_ceiling_and_a_huge_one_fits_an_int():
    libc = FakeLibc()
    allocator.keep_freed(4 * MIB, environ={}, libc=libc)
    allocator.keep_freed(2**40, environ={}, libc=libc)
    assert libc.calls == [(allocator.M_MMAP_THRESHOLD, 32 * MIB),
                          (allocator.M_TRIM_THRESHOLD, 4 * MIB),
                          (allocator.M_MMAP_THRESHOLD, 32 * MIB),
                          (allocator.M_TRIM_THRESHOLD, 2**31 - 1)]


def test_zero_leaves_the_c_librarys_policy():
    libc = FakeLibc()
    kept, said = allocator.keep_freed(0, environ={}, libc=libc)
    assert kept and "own policy" in said and libc.calls == []


@pytest.mark.parametrize("tunables", ["glibc.malloc.trim_threshold=1",
                                      "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=9"])
def test_the_operators_own_tunables_win(tunables):
    libc = FakeLibc()
    said = allocator.keep_freed(64 * MIB, environ={"GLIBC_TUNABLES": tunables}, libc=libc)
    assert said == (True, "the allocator's tunables in GLIBC_TUNABLES") and libc.calls == []


@pytest.mark.parametrize("name", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"])
def test_the_operators_older_settings_win_too(name):
    libc = FakeLibc()
    said = allocator.keep_freed(64 * MIB, environ={name: "131072"}, libc=libc)
    assert said == (True, f"the allocator's settings in {name}") and libc.calls == []


def test_tunables_of_something_else_do_not_stop_it():
    libc = FakeLibc()
    allocator.keep_freed(64 * MIB, environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                         libc=libc)
    assert len(libc.calls) == 2


def test_a_refusal_is_said_as_one():
    kept, said = allocator.keep_freed(64 * MIB, environ={}, libc=FakeLibc(answer=0))
    assert not kept and "refused" in said


@linux
def test_this_process_finds_glibc_among_its_own_symbols():
    libc = allocator._libc()
    assert libc is not None and libc.gnu_get_libc_version() is not None


# Bodies of a megabyte and a little more each round (a growing session's), 32 at once, then
# freed: the page faults of ten rounds after three to warm up.
CHURN = textwrap.dedent("""
    import resource, sys
    from relay import allocator
    print(allocator.keep_freed(int(sys.argv[1]))[1])
    def churn(first, rounds):
        for r in range(first, first + rounds):
            bodies = [b"x" * (1024 * 1024 + 4096 * (i + r)) for i in range(32)]
            del bodies
    churn(0, 3)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn(3, 10)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(limit: int) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", CHURN, str(limit)], capture_output=True,
                          text=True, check=True, timeout=60)
    said, faults = done.stdout.splitlines()
    return said, int(faults)


@linux
@pytest.mark.slow
def test_kept_memory_spares_the_next_bodies_their_page_faults():
    default_said, default = _faults(0)
    kept_said, kept = _faults(64 * MIB)
    assert "own policy" in default_said and "kept for reuse" in kept_said
    # 320 MB of bodies: given back and faulted in again each round (some 80 thousand
    # faults), against the few hundred of each round's growth when kept.
    assert default > 20_000 and kept * 20 < default, (default, kept)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def _sessions(url: str, bodies: list[bytes], sessions: int = 16) -> None:
    """``sessions`` growing sessions at once, each sending ``bodies`` in turn (a
    conversation of a megabyte, one turn longer each request)."""
    def session(n: int) -> None:
        for body in bodies:
            call = urllib.request.Request(url + "/v1/messages", data=body, method="POST", headers={
                "content-type": "application/json", "anthropic-version": "2023-06-01",
                "x-claude-code-session-id": f"session-{n}"})
            with urllib.request.urlopen(call, timeout=60) as answer:
                assert answer.status == 200

    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        list(pool.map(session, range(sessions)))


@linux
def test_the_serving_relay_keeps_what_it_was_told_to(relay, emulator):
    upstream = emulator()
    config = {"backends": [{"name": "emu", "url": upstream.url, "models": ["claude-*"]}]}
    kept = relay({**config, "server": {"log_level": "DEBUG"}})
    given_back = relay({**config, "server": {"keep_freed_bytes": 0, "log_level": "DEBUG"}})
    assert kept.wait_for_output("memory: up to 67108864 bytes of freed memory kept for reuse")
    assert given_back.wait_for_output("memory: the C library's own policy")
    bodies = list(workloads.session_bodies())
    faults = {}
    for name, server in (("kept", kept), ("given back", given_back)):
        _sessions(server.url, bodies[:2])  # warmed up
        before = _minor_faults(server.pid)
        _sessions(server.url, bodies[2:10])
        faults[name] = _minor_faults(server.pid) - before
    assert faults["kept"] * 2 < faults["given back"], faults

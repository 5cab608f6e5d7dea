"""How much freed memory the process keeps for reuse (``server.keep_freed_bytes``).

A coding agent's request is a megabyte or more, and the relay holds each session's previous
request (:mod:`relay.resume`) while the next ones come and go. With glibc's own policy, a
freed body at the top of the heap is handed back to the kernel as soon as more than about
twice the largest block seen lies free there, so the next body takes fresh pages: a page
fault and a page of zeroes for every 4 KB of it, for every request of every session in
flight. Keeping up to ``keep_freed_bytes`` of freed heap lets the next bodies reuse those
pages; the price is that the process's RSS stays up to that much above what it holds after
a burst (docs/operations.md).

glibc only (``mallopt``); elsewhere, and where the operator set the allocator's tunables
(``GLIBC_TUNABLES``), this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), which its
# own dynamic threshold also climbs to: blocks below it come from the heap, where freed
# pages can be reused. Setting either parameter fixes both, so both are set, and this one
# always at the ceiling (below a body's size, every body would be a fresh mapping).
MMAP_THRESHOLD = 32 * 1024 * 1024
_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold")


def _libc():
    """The C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc's alone


def keep_freed(limit: int, environ=os.environ, libc=None) -> str:
    """Keep up to ``limit`` bytes of freed heap for reuse (0: the C library's own policy);
    says what was done, for the log."""
    if limit <= 0:
        return "the C library's own policy (server.keep_freed_bytes: 0)"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in tunables for name in _TUNABLES):
        return "the allocator's tunables in GLIBC_TUNABLES"
    libc = libc if libc is not None else _libc()
    if libc is None:
        return "the C library's own policy (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, min(limit, 2**31 - 1))):
        return "the C library's own policy (mallopt refused)"
    return f"up to {limit} bytes of freed memory kept for reuse"

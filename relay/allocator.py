"""How much freed memory the process keeps for reuse (``server.keep_freed_bytes``).

A coding agent's request is a megabyte or more, and the relay holds each session's previous
request (:mod:`relay.resume`) while the next ones come and go. With glibc's own policy, a
freed body at the top of the heap is handed back to the kernel as soon as more than about
twice the largest block seen lies free there, so the next body takes fresh pages: a page
fault and a page of zeroes for every 4 KB of it, for every request of every session in
flight. Keeping up to ``keep_freed_bytes`` of freed heap lets the next bodies reuse those
pages; the price is that the process's RSS stays up to that much above what it holds after
a burst (docs/operations.md).

glibc only (``mallopt``); elsewhere, and where the operator set the allocator's thresholds
(``GLIBC_TUNABLES``, or glibc's older ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``),
this does nothing.
"""

from __future__ import annotations

import ctypes
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
_OLDER = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # glibc still reads them


def _libc():
    """The C library when it is glibc, else None: the process's own symbols, which hold the C
    library's (no search for the library's file, which would run ``ldconfig``)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc's alone


def keep_freed(limit: int, environ=os.environ, libc=None) -> tuple[bool, str]:
    """Keep up to ``limit`` bytes of freed heap for reuse (0: the C library's own policy).
    Says what was done, for the log, and False when glibc refused what it was asked."""
    if limit <= 0:
        return True, "the C library's own policy (server.keep_freed_bytes: 0)"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in tunables for name in _TUNABLES):
        return True, "the allocator's tunables in GLIBC_TUNABLES"
    older = [name for name in _OLDER if name in environ]
    if older:
        return True, f"the allocator's settings in {' and '.join(older)}"
    libc = libc if libc is not None else _libc()
    if libc is None:
        return True, "the C library's own policy (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, min(limit, 2**31 - 1))):
        return False, "the C library's own policy (mallopt refused server.keep_freed_bytes)"
    return True, f"up to {limit} bytes of freed memory kept for reuse"

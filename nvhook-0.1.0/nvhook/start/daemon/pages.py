"""What nvhookd's spares copy before they serve: the pages request children were seen to write.

Python writes the reference count of every object it touches, so a request child of the daemon
copies ~1,000 of its pages on write while serving, one fault each (~4 us). The first
LEARN_REQUESTS request children report those pages (touched_pages, sent to the daemon as one
`report` on its learn pipe); the daemon merges the reports (`merge`, bounded, and only pages of
its own private writable mappings, which its spares inherit) and each new spare copies them
while idle (prefault), so that serving takes ~3x fewer page faults.
"""

from __future__ import annotations

import os

LEARN_REQUESTS = 16  # request children that report the pages they copied (see touched_pages)
LEARN_RUN_PAGES, LEARN_PAGES = 4096, 16384  # at most 16 MiB in one run, 64 MiB in all
REPORT_RUNS = 340  # runs in one report: one atomic pipe write (PIPE_BUF)

# madvise(2) advice: populate page tables writable, copying copy-on-write pages (Linux 5.14).
MADV_POPULATE_WRITE = 23
_LARGEST_MAPPING = 64 << 20  # bigger ones (a thread's stack, a reservation) are not the heap


def _private_writable(maps: list[bytes]) -> list[tuple[int, int]]:
    out = []
    for line in maps:
        fields = line.split()
        if len(fields) < 2 or not fields[1].startswith(b"rw") or fields[1][3:4] != b"p":
            continue
        if len(fields) > 5 and fields[5].startswith((b"[stack", b"[v")):
            continue
        start, _, end = fields[0].partition(b"-")
        lo, hi = int(start, 16), int(end, 16)
        if hi - lo <= _LARGEST_MAPPING:
            out.append((lo, hi))
    return out


def _own_private_pages() -> list[tuple[int, int]]:
    """(first page, end page) of this process's private writable mappings (touched_pages' view)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().splitlines()
    except OSError:
        return []
    return [(lo // page, hi // page) for lo, hi in _private_writable(maps)]


def as_runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) runs."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def touched_pages() -> list[tuple[int, int]]:
    """(first page, count) runs of this process's private writable pages that it no longer
    shares (/proc/self/pagemap: present and exclusively mapped): in a child of the daemon, the
    pages it copied on write since the fork, or allocated. Python writes the reference count of
    every object it touches, so serving a request copies ~1,000 pages, one fault each (~4 us)."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().splitlines()
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return runs
    try:
        for lo, hi in _private_writable(maps):
            first = lo // page
            entries = memoryview(os.pread(fd, (hi - lo) // page * 8, first * 8)).cast("Q")
            start = -1
            for i, e in enumerate(entries):
                if e >> 63 and e >> 56 & 1:
                    if start < 0:
                        start = i
                elif start >= 0:
                    runs.append((first + start, i - start))
                    start = -1
            if start >= 0:
                runs.append((first + start, len(entries) - start))
    except (OSError, ValueError, TypeError):
        return []
    finally:
        os.close(fd)
    return runs


def prefault(runs: list[tuple[int, int]]) -> None:
    """Copy the pages of `runs` now (MADV_POPULATE_WRITE); best effort: an older kernel
    (EINVAL) or a range no longer mapped is left as it is."""
    if not runs:
        return
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    for first, n in runs:
        madvise(first * page, n * page, MADV_POPULATE_WRITE)


def report() -> bytes:
    """This process's touched pages as one message for the daemon's learn pipe."""
    got = touched_pages()[:REPORT_RUNS]
    return len(got).to_bytes(4, "little") + b"".join(
        a.to_bytes(8, "little") + n.to_bytes(4, "little") for a, n in got)


def merge(data: bytes, learned: set[int]) -> int:
    """Add the pages the reports in `data` name to `learned`; the number of reports.

    Only pages of our own private writable mappings, which the spares inherit: a report naming
    anything else (a bug, a process that inherited the pipe: a request child's forked ldconfig
    worker does) would have every later spare populate memory that is not the heap (a thread's
    stack, a shared mapping, an address madvise's conversion truncates)."""
    ours = _own_private_pages()
    reports = 0
    while len(data) >= 4:
        n = int.from_bytes(data[:4], "little")
        body, data = data[4:4 + 12 * n], data[4 + 12 * n:]
        for i in range(0, len(body) - 11, 12):
            first = int.from_bytes(body[i:i + 8], "little")
            count = int.from_bytes(body[i + 8:i + 12], "little")
            if count <= LEARN_RUN_PAGES and len(learned) < LEARN_PAGES:  # bounded, whatever arrives
                for lo, hi in ours:
                    learned.update(range(max(lo, first), min(hi, first + count)))
        reports += 1
    return reports

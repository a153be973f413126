"""A process and the processes under it, read from Linux's ``/proc`` (the service's load figures).

Used by ``benchmarks/service_load.py`` (peak memory of ``ntp-opt serve`` and
its workers) and by the service's tests (workers must not outlive the server).
Elsewhere than Linux every process looks gone: no children, zero memory.
"""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), ``pid`` itself left out."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def status_kb(pid: int, key: str) -> int:
    """A kB figure of ``/proc/PID/status`` (``"VmRSS"``, ``"VmHWM"``, ...); 0 if there is none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kb(pid: int) -> tuple[int, int]:
    """The summed resident memory (kB) of ``pid`` and its descendants, and how many processes.

    An overestimate: pages shared between processes count once per process.
    """
    pids = [pid, *descendants(pid)]
    return sum(status_kb(p, "VmRSS") for p in pids), len(pids)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")

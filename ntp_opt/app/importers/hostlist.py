"""Slurm hostlist expressions: ``gb-[001-018]``, ``a[1-3,5],b7``, ``rack[1-2]-n[01-02]``.

The grammar follows Slurm's hostlist parser as its man pages describe it
(``topology.conf(5)``: ``Nodes=tux[0-3,12,18-20]``): a comma-separated list of
host expressions, where commas inside brackets do not separate hosts; each
expression is literal text with zero or more bracket groups; a bracket group
is a comma-separated list of numbers and ``lo-hi`` ranges. A number written
with leading zeros fixes the width (``[001-018]`` gives ``001`` ... ``018``);
several bracket groups expand as a cartesian product, leftmost slowest.
"""

from __future__ import annotations

import re

__all__ = ["MAX_HOSTS", "HostlistError", "expand"]

#: Largest number of hosts one expression may expand to (guards against ``n[0-999999999]``).
MAX_HOSTS = 1_000_000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """A malformed hostlist expression; the message says what and where."""


def _split_top(expr: str) -> list[str]:
    """Split at commas outside brackets; check bracket nesting."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            if depth:
                raise HostlistError(f"nested '[' at position {i} in {expr!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"unmatched ']' at position {i} in {expr!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in {expr!r}")
    parts.append(expr[start:])
    return parts


def _numbers(group: str, expr: str) -> list[str]:
    """The zero-padded numbers of one bracket group's content."""
    if not group:
        raise HostlistError(f"empty brackets in {expr!r}")
    out: list[str] = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item)
        if m is None:
            raise HostlistError(f"bad range {item!r} in {expr!r} (expected N or LO-HI)")
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = lo if hi_s is None else int(hi_s)
        if hi < lo:
            raise HostlistError(f"range {item!r} in {expr!r} runs backwards")
        if hi - lo + 1 + len(out) > MAX_HOSTS:
            raise HostlistError(f"{expr!r} expands to more than {MAX_HOSTS} hosts")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_one(part: str, expr: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", part)
    # pieces alternate literal, group, literal, group, ..., literal
    hosts = [pieces[0]]
    for k in range(1, len(pieces), 2):
        nums = _numbers(pieces[k], expr)
        if len(hosts) * len(nums) > MAX_HOSTS:
            raise HostlistError(f"{expr!r} expands to more than {MAX_HOSTS} hosts")
        hosts = [h + n + pieces[k + 1] for h in hosts for n in nums]
    return hosts


def expand(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in order.

    Parameters
    ----------
    expr : str
        For example ``"gb-[001-018]"``, ``"a[1-3,5],b7"`` or ``"r[1-2]n[01-02]"``.

    Returns
    -------
    list of str
        The host names in the order the expression lists them (duplicates kept, so
        that callers can report them).

    Raises
    ------
    HostlistError
        On unbalanced or nested brackets, empty brackets, a range that is not
        ``N`` or ``LO-HI`` or runs backwards, an empty host name, whitespace inside
        the expression, or more than :data:`MAX_HOSTS` hosts.

    Examples
    --------
    >>> expand("gb-[001-003]")
    ['gb-001', 'gb-002', 'gb-003']
    >>> expand("a[1-3,5],b7")
    ['a1', 'a2', 'a3', 'a5', 'b7']
    """
    if not isinstance(expr, str):
        raise HostlistError(f"expected a hostlist string, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise HostlistError("empty hostlist")
    if re.search(r"\s", expr):
        raise HostlistError(f"whitespace inside hostlist {expr!r}")
    out: list[str] = []
    for part in _split_top(expr):
        if not part:
            raise HostlistError(f"empty host name in {expr!r} (stray comma)")
        out.extend(_expand_one(part, expr))
        if len(out) > MAX_HOSTS:
            raise HostlistError(f"{expr!r} expands to more than {MAX_HOSTS} hosts")
    return out

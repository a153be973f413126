"""Slurm hostlist expressions: ``gb-[001-018]``, ``a[1-3,5],b7``, ``rack[1-2]-n[01-02]``.

The grammar follows Slurm's hostlist parser as its man pages describe it
(``topology.conf(5)``: ``Nodes=tux[0-3,12,18-20]``): a comma-separated list of
host expressions, where commas inside brackets do not separate hosts; each
expression is literal text with zero or more bracket groups; a bracket group
is a comma-separated list of numbers and ``lo-hi`` ranges. A number written
with leading zeros fixes the width (``[001-018]`` gives ``001`` ... ``018``);
several bracket groups expand as a cartesian product, leftmost slowest.

Expansion is bounded before any name is made: a :class:`Budget` (one per
file) caps the number of names and their total length, and each name is at
most :data:`MAX_NAME` characters; the size of an expression is computed from
its ranges first, so ``x[0-999999999]`` or a 20,000-character prefix times a
million costs nothing but the error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ntp_opt.model.files import MAX_NODES

__all__ = ["MAX_CHARS", "MAX_HOSTS", "MAX_NAME", "Budget", "HostlistError", "expand"]

#: Largest number of host names one file (one :class:`Budget`) may expand to: an
#: instance holds at most ``MAX_NODES`` nodes, and every host is at least one.
MAX_HOSTS = MAX_NODES
#: Largest total length, in characters, of the names one file may expand to
#: (64 characters a name on average at :data:`MAX_HOSTS` names).
MAX_CHARS = 64 * MAX_HOSTS
#: Longest host name (DNS allows 253 characters; Linux host names 64).
MAX_NAME = 255
#: Most digits in one number of a range (more is no host name).
_MAX_DIGITS = 18

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """A malformed hostlist expression; the message says what and where."""


@dataclass
class Budget:
    """What is left to expand in one file: names and total characters.

    Attributes
    ----------
    names : int
        Host names still allowed (starts at :data:`MAX_HOSTS`).
    chars : int
        Characters still allowed (starts at :data:`MAX_CHARS`).
    """

    names: int = MAX_HOSTS
    chars: int = MAX_CHARS

    def take(self, names: int, chars: int, expr: str) -> None:
        """Spend ``names`` names of at most ``chars`` characters in all, or raise.

        Raises
        ------
        HostlistError
            When the file would expand to more than :data:`MAX_HOSTS` names or
            :data:`MAX_CHARS` characters.
        """
        if names > self.names:
            raise HostlistError(
                f"{_short(expr)} expands to {names} names: more than the {MAX_HOSTS} "
                "host names a file may expand to"
            )
        if chars > self.chars:
            raise HostlistError(
                f"{_short(expr)} expands to up to {chars} characters: more than the "
                f"{MAX_CHARS} characters of host names a file may expand to"
            )
        self.names -= names
        self.chars -= chars


def _short(expr: str) -> str:
    """``expr`` quoted, cut to 60 characters (error messages stay one short line)."""
    return repr(expr) if len(expr) <= 60 else repr(expr[:57] + "...")


def _split_top(expr: str) -> list[str]:
    """Split at commas outside brackets; check bracket nesting."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            if depth:
                raise HostlistError(f"nested '[' at position {i} in {_short(expr)}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"unmatched ']' at position {i} in {_short(expr)}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in {_short(expr)}")
    parts.append(expr[start:])
    return parts


def _ranges(group: str, expr: str) -> list[tuple[int, int, int]]:
    """``(lo, hi, width)`` of each item of one bracket group (nothing expanded)."""
    if not group:
        raise HostlistError(f"empty brackets in {_short(expr)}")
    out: list[tuple[int, int, int]] = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item)
        if m is None:
            raise HostlistError(f"bad range {_short(item)} in {_short(expr)} (expected N or LO-HI)")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        if max(len(lo_s), len(hi_s)) > _MAX_DIGITS:
            raise HostlistError(f"number with more than {_MAX_DIGITS} digits in {_short(expr)}")
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostlistError(f"range {item!r} in {_short(expr)} runs backwards")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.append((lo, hi, width))
    return out


def _expand_one(part: str, expr: str, budget: Budget) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", part)
    # pieces alternate literal, group, literal, group, ..., literal
    groups = [_ranges(pieces[k], expr) for k in range(1, len(pieces), 2)]
    count = 1
    longest = sum(len(pieces[k]) for k in range(0, len(pieces), 2))
    for g in groups:
        count *= sum(hi - lo + 1 for lo, hi, _ in g)
        longest += max(max(w, len(str(hi))) for _, hi, w in g)
    if longest > MAX_NAME:
        raise HostlistError(
            f"{_short(expr)} makes names of up to {longest} characters, more than {MAX_NAME}"
        )
    budget.take(count, count * longest, expr)  # before a single name is made
    hosts = [pieces[0]]
    for k, g in enumerate(groups):
        nums = [str(n).zfill(w) for lo, hi, w in g for n in range(lo, hi + 1)]
        tail = pieces[2 * k + 2]
        hosts = [h + n + tail for h in hosts for n in nums]
    return hosts


def expand(expr: str, budget: Budget | None = None) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in order.

    Parameters
    ----------
    expr : str
        For example ``"gb-[001-018]"``, ``"a[1-3,5],b7"`` or ``"r[1-2]n[01-02]"``.
    budget : Budget, optional
        What the caller's file may still expand to (shared by every expression
        of one file); a fresh :class:`Budget` when omitted.

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
        the expression, a name longer than :data:`MAX_NAME`, or more names or
        characters than the budget allows (checked before expanding).

    Examples
    --------
    >>> expand("gb-[001-003]")
    ['gb-001', 'gb-002', 'gb-003']
    >>> expand("a[1-3,5],b7")
    ['a1', 'a2', 'a3', 'a5', 'b7']
    """
    if not isinstance(expr, str):
        raise HostlistError(f"expected a hostlist string, got {type(expr).__name__}")
    budget = Budget() if budget is None else budget
    expr = expr.strip()
    if not expr:
        raise HostlistError("empty hostlist")
    if re.search(r"\s", expr):
        raise HostlistError(f"whitespace inside hostlist {_short(expr)}")
    out: list[str] = []
    for part in _split_top(expr):
        if not part:
            raise HostlistError(f"empty host name in {_short(expr)} (stray comma)")
        out.extend(_expand_one(part, expr, budget))
    return out

"""Untrusted text made safe to print: control characters escaped, long echoes cut.

Names, ids, labels and paths come from files, requests and command lines; a
terminal would obey the escape sequences in them (retitle the window, clear
the screen) and a megabyte label would bury the message. Every echo of such
text on a terminal, in a log or in an error body goes through :func:`echo`.
"""

from __future__ import annotations

__all__ = ["MAX_ECHO", "echo"]

#: Characters of one echo shown before it is cut.
MAX_ECHO = 200

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(ch: str) -> str:
    if ch.isprintable():
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def echo(text: object, limit: int | None = MAX_ECHO) -> str:
    """``text`` as one printable line: control characters escaped, cut after ``limit``.

    Parameters
    ----------
    text
        Anything; ``str(text)`` is shown.
    limit
        Largest number of characters shown (after escaping); the rest is
        replaced by ``… (N more characters)``. ``None``: no limit.

    Returns
    -------
    str
        Printable characters only (``str.isprintable`` plus spaces): ESC,
        BEL, newlines, bidirectional overrides and the like appear as
        ``\\x1b``, ``\\x07``, ``\\n``, ``\\u202e``.
    """
    s = str(text)
    if (limit is None or len(s) <= limit) and s.isprintable():
        return s
    out: list[str] = []
    size = 0
    for i, ch in enumerate(s):
        piece = _escaped(ch)
        if limit is not None and size + len(piece) > limit:
            return "".join(out) + f"… ({len(s) - i} more characters)"
        out.append(piece)
        size += len(piece)
    return "".join(out)

"""Every dotted ``ntp_opt.…`` name in the docs and in the package's docstrings exists.

Modules move (issue 34 split eight of them); a docstring or page that still
names the old place sends a reader nowhere. This reads ``README.md``,
``docs/*.md``, ``instances/README.md`` and every module of ``ntp_opt/``, and
imports or looks up each ``ntp_opt.a.b.c`` it finds.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![\w/])ntp_opt(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
#: Placeholders of the recipes ("ntp_opt/planners/NAME.py", "tests/X/test_Y.py").
PLACEHOLDERS = {"NAME", "X", "Y"}


def _texts() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "instances" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
    return pages + sorted((ROOT / "ntp_opt").rglob("*.py"))


def _has(obj: object, attr: str) -> bool:
    """``obj.attr`` exists, or ``obj`` is a class declaring the field ``attr``."""
    if hasattr(obj, attr):
        return True
    return isinstance(obj, type) and any(
        attr in getattr(k, "__annotations__", {}) for k in obj.__mro__
    )


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    obj: object = None
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # old paths: see below
                obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as e:
            if e.name is not None and not e.name.startswith("ntp_opt"):
                pytest.skip(f"{dotted}: optional package {e.name} is not installed")
    for attr in parts[i:]:
        if not _has(obj, attr):
            return False
        obj = getattr(obj, attr, None)
    return True


def _references() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _texts():
        for name in set(NAME.findall(path.read_text(encoding="utf-8"))):
            if PLACEHOLDERS.isdisjoint(name.split(".")):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_dotted_name_exists() -> None:
    refs = _references()
    assert len(refs) > 300  # the scan reads what it should
    bad = {name: where for name, where in sorted(refs.items()) if not _resolves(name)}
    assert not bad, "names that do not exist: " + "; ".join(
        f"{name} (in {', '.join(where[:3])})" for name, where in bad.items()
    )


def test_the_check_catches_a_moved_name() -> None:
    # the names issue 34 moved: the check must refuse their old places
    assert not _resolves("ntp_opt.planners.exact.model.merged_capacity")
    assert not _resolves("ntp_opt.planners.exact.bounds.stage_bound")
    assert _resolves("ntp_opt.planners.exact.merged.merged_capacity")
    assert _resolves("ntp_opt.model.instance.Instance.cluster")  # a field, set per instance

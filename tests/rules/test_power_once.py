"""Power arithmetic lives once, in ``ntp_opt/rules/``: no power budget is compared elsewhere.

Outside ``ntp_opt/rules/`` a draw meets a rack or site budget only through
:mod:`ntp_opt.rules.power` (``fits``, ``exceeds``, ``fits_mw``, ``budget_limit``,
``over_budget``, ...), so the tolerance of every budget test is the one named in
:mod:`ntp_opt.rules.tolerances`. The scan below reads the package's syntax trees and
fails on a comparison (``<``, ``<=``, ``>``, ``>=``) with a power budget in an
operand, or a budget scaled by a hand-made tolerance (``budget * (1 + tol)``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np

from ntp_opt.rules import boost, power

PACKAGE = Path(__file__).resolve().parents[2] / "ntp_opt"
RULES = PACKAGE / "rules"

#: Names of power budgets: ``rack_budget``, ``site_budget``, ``budget_mw``, ``budget_r``,
#: ``budget0``, ``power_budget_w``, a bare ``budget``; not ``body_budget`` (bytes) or a
#: ``Budget`` object's attributes (``budget.left``: the attribute is what is compared).
BUDGET = re.compile(r"^(?:(?:rack|site|power)_)?budgets?(?:_(?:r|w|mw|kw)|\d+)?(?:_w)?$")

#: Calls whose arguments may hold budgets: the rules' own functions.
ALLOWED_CALLS = frozenset(power.__all__) | frozenset(boost.__all__) | {"budget_fits"}

ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_budget(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return bool(BUDGET.match(node.id))
    if isinstance(node, ast.Attribute):
        return bool(BUDGET.match(node.attr))
    return False


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _mentions_budget(node: ast.AST) -> bool:
    """Does the expression read a budget other than through a rules function?"""
    if _is_budget(node):
        return True
    if isinstance(node, ast.Call) and _call_name(node) in ALLOWED_CALLS:
        return False
    if isinstance(node, ast.Attribute):  # ``budget.left``: only the attribute counts
        return False
    return any(_mentions_budget(child) for child in ast.iter_child_nodes(node))


def _one_plus(node: ast.AST) -> bool:
    """``(1 + x)`` or ``(1.0 + x)``: a hand-made relative tolerance."""
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add)
        and isinstance(node.left, ast.Constant)
        and node.left.value in (1, 1.0)
    )


def budget_tests(source: str) -> list[tuple[int, str]]:
    """The lines of ``source`` that compare a power budget or scale one by ``1 + tol``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, ORDER) for op in node.ops):
            sides = [node.left, *node.comparators]
            if all(isinstance(x, ast.Constant) or _is_budget(x) for x in sides):
                continue  # a budget's sign (``budget > 0``), no draw in it
            if any(_mentions_budget(x) for x in sides):
                found.append((node.lineno, "comparison"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            pair = (node.left, node.right)
            if any(
                _is_budget(x) or (isinstance(x, ast.Subscript) and _is_budget(x.value))
                for x in pair
            ) and any(_one_plus(x) for x in pair):
                found.append((node.lineno, "budget * (1 + tol)"))
    return found


def test_no_budget_compared_outside_rules() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if RULES in path.parents:
            continue
        for line, what in budget_tests(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, "power budgets compared outside ntp_opt/rules/:\n" + "\n".join(offenders)


def test_the_scan_sees_budget_tests() -> None:
    """The scan flags the forms it is there for, and not unrelated code."""
    flagged = [
        "over = power > budget * (1 + 1e-6)",
        "ok = a.site_budget >= site",
        "x = np.any(rack > a.rack_budget[r])",
        "ok = math.ceil(w * MW) <= budget_mw",
        "cap = a.rack_budget * (1 + BUDGET_SLACK)",
        "cap = a.rack_budget[i] * (1 + POWER_TOL) + WATT_SLACK",
        "ok = ceil_mw(idle + x) <= budget",
    ]
    for src in flagged:
        assert budget_tests(src), src
    unflagged = [
        "ok = fits(site, a.site_budget)",
        "ok = np.any(exceeds(rack, a.rack_budget, tol=0.0, slack=0.0))",
        "ok = self.body_bytes + reserve > self.limits.body_budget",
        "ok = budget.left > 3",
        "room = a.site_budget - idle",
        "ok = len(budgets) == 2",
        "ok = rack_cap[r] < rack[r]",
        "share = np.where(budget > 0, budget, np.inf)",
    ]
    for src in unflagged:
        assert not budget_tests(src), src


def test_fits_is_the_validators_tolerance() -> None:
    """``fits`` forgives exactly ``budget * POWER_TOL + WATT_SLACK`` (values from the docs)."""
    budget = 1000.0
    slack = budget * 1e-9 + 1e-9  # POWER_TOL and WATT_SLACK as docs/model.md gives them
    assert power.fits(budget + slack * 0.5, budget)
    assert not power.fits(budget + slack * 2, budget)
    assert power.exceeds(budget + slack * 2, budget)
    assert not power.fits(1000.5, 1000.0, tol=1e-12, slack=0.0)
    drawn = np.array([999.0, 1000.0, 1001.0])
    assert power.fits(drawn, np.full(3, 1000.0)).tolist() == [True, True, False]


def test_milliwatts_round_draws_up_and_budgets_down() -> None:
    assert power.ceil_mw(1.00001) == 1001  # 1000.01 mW, up
    assert power.ceil_mw(2.0) == 2000  # exactly at a whole mW: not one more
    assert power.ceil_mw(2.0000001) == 2000  # 0.0001 mW over: float noise, forgiven
    assert power.floor_mw(2.9999) == 2999
    assert power.fits_mw(2.0, 2000) and not power.fits_mw(2.0011, 2000)
    assert power.fits_mw(np.array([2.0, 2.0011]), 2000).tolist() == [True, False]
    assert power.ceil_mw_array(np.array([1.00001, 2.0000001])).tolist() == [1001.0, 2000.0]

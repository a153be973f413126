"""Every numeric tolerance of the rules and planners, named once.

Values are part of the planners' behaviour: changing one changes results
(``instances/best_known.md``). Relative tolerances multiply the quantity they
guard (``x * (1 + TOL)``); absolute ones are added.
"""

from __future__ import annotations

__all__ = [
    "ABS_NOISE",
    "BISECT_TOL",
    "BOOST_MARGIN",
    "BOUND_ABS_SLACK",
    "BOUND_TOL",
    "BUDGET_SLACK",
    "EDGE_SLACK",
    "FLOAT_NOISE",
    "HIGHS_INT_TOL",
    "HIGHS_MIN_INT_TOL",
    "IMPROVE_TOL",
    "INT_BOUND_ABS_TOL",
    "INT_BOUND_REL_TOL",
    "INT_ROUND_TOL",
    "METRIC_ABS_TOL",
    "METRIC_TOL",
    "MW_ROUND_SLACK",
    "POWER_TOL",
    "PROBE_STEP",
    "PROB_CLIP",
    "REL_TOL",
    "ROUNDING_SHIFT",
    "SHARE_TOL",
    "SPLIT_TOL",
    "THRESHOLD_TOL",
    "TIGHTEN_TOL",
    "WATT_SLACK",
    "WHOLE_WATT_NOISE",
]

#: Relative slack of the validator's power checks (board limits, rack and site budgets):
#: a draw up to ``budget * (1 + POWER_TOL) + WATT_SLACK`` is within budget.
POWER_TOL = 1e-9

#: Absolute slack, in watts, added to a budget by the validator's power checks.
WATT_SLACK = 1e-9

#: Watts added before a draw is rounded down to whole watts (an exported power limit),
#: so that float noise below a whole watt never costs one.
WHOLE_WATT_NOISE = 1e-9

#: Relative slack of the planners' own "fits at power 1" budget tests (stricter than
#: the validator's, so a plan they accept always validates).
BUDGET_SLACK = 1e-12

#: Share of the remaining rack and site room a boost leaves unspent, so rounding never
#: breaks a budget.
BOOST_MARGIN = 1e-9

#: Relative tolerance of a plan's reported metrics against the recomputed ones.
METRIC_TOL = 1e-6

#: Absolute tolerance of a plan's reported metrics against the recomputed ones.
METRIC_ABS_TOL = 1e-12

#: Relative float noise forgiven when comparing two computed figures (speeds, goodputs,
#: step times): ``a > b * (1 + FLOAT_NOISE)`` means strictly better.
FLOAT_NOISE = 1e-12

#: Relative gain a planner's move must bring to count as an improvement.
IMPROVE_TOL = 1e-9

#: Relative optimality gap at which an exact search stops (bound vs value).
REL_TOL = 1e-6

#: Relative slack of the multi-workload shares (serving fractions, training minimum).
SHARE_TOL = 1e-9

#: Largest failure probability used under a logarithm (``log1p(-p)`` stays finite).
PROB_CLIP = 1 - 1e-15

#: Relative slack of "a value never exceeds its proven upper bound" checks.
BOUND_TOL = 1e-9

#: Relative slack of the batch split's candidate cut-off (``theta_K (1 + SPLIT_TOL)``).
SPLIT_TOL = 1e-9

#: Absolute float noise forgiven when a computed difference (a swap's speed gain, a bound
#: minus a value) is compared with zero: ``gain > ABS_NOISE`` means a real gain.
ABS_NOISE = 1e-12

#: Relative slack by which the exact search widens a step-time bracket, or adds before
#: rounding a computed batch level down, so float noise never cuts off a feasible point.
EDGE_SLACK = 1e-9

#: Relative slack of the exact model's rack and site budget checks while tightening a
#: step time (looser than ``BUDGET_SLACK``, inside the validator's ``POWER_TOL``).
TIGHTEN_TOL = 1e-10

#: Relative width at which the exact model's step-time bisection stops.
BISECT_TOL = 1e-12

#: Smallest relative step above a bracket's left end taken by the exact search's probes.
PROBE_STEP = 1e-15

#: Absolute slack added to a solver's fractional bound before rounding it down to an
#: integer batch.
INT_ROUND_TOL = 1e-6

#: Absolute slack (weighted goodput) of the multi-workload optimality proof (bound vs value).
BOUND_ABS_SLACK = 1e-9

#: Relative slack when comparing a relative goodput with a threshold (spares' stall test).
THRESHOLD_TOL = 1e-9

#: Slack, in milliwatts, forgiven when the exact model rounds a draw to integer mW, so
#: that a plan exactly at a budget (a full rack at TDP) is not excluded by float noise.
MW_ROUND_SLACK = 1e-3

#: Absolute slack added to an integer program's floating-point bound before it is
#: rounded down (absorbs HiGHS and CBC tolerances; a larger bound stays valid).
INT_BOUND_ABS_TOL = 1e-6

#: Relative slack added to an integer program's floating-point bound before it is
#: rounded down.
INT_BOUND_REL_TOL = 1e-9

#: HiGHS's default integrality tolerance (``mip_feasibility_tolerance``).
HIGHS_INT_TOL = 1e-6

#: HiGHS's smallest accepted integrality tolerance.
HIGHS_MIN_INT_TOL = 1e-10

#: Largest change of a row's activity that rounding one HiGHS variable may cause.
ROUNDING_SHIFT = 1e-2

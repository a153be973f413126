"""Risk-aware planning: maximise expected goodput after recourse (docs/model.md, spec section 4).

The planner starts from the risk-blind optimum (``solve(instance,
"optimal")``) and improves the *expected* goodput after the deterministic
recourse of :func:`ntp_opt.rules.recourse.adapt`, never letting the nominal goodput
(no new failure) fall below ``(1 - nominal_tolerance)`` times the optimum's.

The expectation is taken over a fixed set of *training* scenarios:

* every scenario with its probability when the instance has at most
  ``exact_units`` independent failure units (the objective is then the exact
  expected goodput), else
* ``samples`` scenarios drawn with :func:`ntp_opt.model.failures.sample_failure_events`
  (sample-average approximation, SAA), seeded.

What placement controls under the recourse rules (``docs/failures.md``):
which domains and GPUs are spares (recourse never brings a spare *domain*
into the job, and a failed spare GPU costs nothing), and which domains share a
replica (a replica is as slow as its slowest stage, and drops out as a
whole, so risky domains packed into one replica hit fewer replicas). The
search therefore uses five kinds of moves, each scored by the training
objective and kept when it strictly improves it (or ties it and lowers the
summed failure probability of the GPUs in use):

1. *regroup*: inside each TP degree, sort the stages by risk and group them
   ``pp`` at a time (risky stages together);
2. *move a stage* to the unused healthy GPUs of another domain (the least
   risky ones), leaving the risky domain spare;
3. *swap a GPU* of a stage with an unused, less risky GPU of the same domain;
4. *swap two stages* of different replicas with the same degree;
5. *exchange two domains*' stages (domains with the same healthy GPUs).

Moves keep each stage's power multiplier; a move that breaks a rack or site
budget, or puts a boosted stage on a board that does not accept its power
(``max_power_w``), is rejected. Batches are re-split exactly after every move. The final
plan passes :func:`ntp_opt.rules.validate.check` in :func:`ntp_opt.solve.solve`
(the planner returns it unchecked); its metrics carry the training
objective (``saa_expected_goodput``, ``saa_method``) and an estimate on
*fresh* scenarios the search never saw (``expected_goodput``,
``expected_method``, ``expected_ci_low``, ``expected_ci_high``). See
``docs/risk.md``.

Modules: :mod:`~ntp_opt.planners.riskaware.scenarios` (scenarios, objective,
GPU risk), :mod:`~ntp_opt.planners.riskaware.scorer` (the exact fast scorer),
:mod:`~ntp_opt.planners.riskaware.search` (moves and local search on a
:class:`~ntp_opt.model.layout.Layout`), :mod:`~ntp_opt.planners.riskaware.waitandsee`
(the wait-and-see bound on the expected goodput of every plan),
:mod:`~ntp_opt.planners.riskaware.nonanticipative` (the domain bound: the
plan's domains and replica groups the same in every scenario),
:mod:`~ntp_opt.planners.riskaware.planner` (:func:`plan_risk_aware`); the built
instances live in
:mod:`ntp_opt.model.risk_instances` and are re-exported here.
"""

from ntp_opt.model.risk_instances import RISK_INSTANCES, risk_instance
from ntp_opt.planners.riskaware.planner import (
    BLIND_SHARE,
    EVAL_SHARE,
    WS_AUTO_GPUS,
    WS_AUTO_SCENARIOS,
    RiskAwareOutcome,
    plan_risk_aware,
)
from ntp_opt.planners.riskaware.scenarios import (
    Scenarios,
    fresh_scenarios,
    gpu_risk,
    objective,
    scenario_goodputs,
    training_scenarios,
)
from ntp_opt.planners.riskaware.search import FAMILIES
from ntp_opt.planners.riskaware.waitandsee import (
    WS_MAX_GPUS,
    WaitAndSee,
    relaxed_instance,
    wait_and_see_bound,
)

__all__ = [
    "BLIND_SHARE",
    "EVAL_SHARE",
    "FAMILIES",
    "RISK_INSTANCES",
    "WS_AUTO_GPUS",
    "WS_AUTO_SCENARIOS",
    "WS_MAX_GPUS",
    "RiskAwareOutcome",
    "Scenarios",
    "WaitAndSee",
    "fresh_scenarios",
    "gpu_risk",
    "objective",
    "plan_risk_aware",
    "relaxed_instance",
    "risk_instance",
    "scenario_goodputs",
    "training_scenarios",
    "wait_and_see_bound",
]

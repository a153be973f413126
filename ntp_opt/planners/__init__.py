"""The planners layer: heuristics, ``fast``, swaps, Megatron peers, the exact search, risk-aware.

Each planner takes an :class:`~ntp_opt.model.instance.Instance` and returns a plan;
:mod:`ntp_opt.solve` picks one by name, validates what it returns and wraps it in a ``Result``.
"""

"""The planners layer: heuristics, ``fast``, swaps, Megatron peers, the exact search, risk-aware.

Each planner takes an :class:`~ntp_opt.model.instance.Instance`; as registered in
:data:`ntp_opt.planners.registry.REGISTRY` it is a :class:`~ntp_opt.planners.base.Planner`
returning an :class:`~ntp_opt.planners.base.Outcome`. :mod:`ntp_opt.solve` picks one by
name, validates what it returns (once) and wraps it in a ``Result``.
"""

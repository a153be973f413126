"""Several workloads over time: the static-partition baseline, demand traces, the
re-planner and the replay (``docs/workloads.md``).

* :mod:`.static`: :func:`~ntp_opt.workflows.multi.static.solve_static`, the
  static partition (its training part planned by :func:`ntp_opt.solve`);
* :mod:`.demand`: the ``ntp-opt/demand@1`` trace file and the trace generator;
* :mod:`.migration`: migration cost, hysteresis options, moves between plans;
* :mod:`.context`, :mod:`.fill`, :mod:`.replanner`: the incremental re-planner
  :func:`~ntp_opt.workflows.multi.replanner.replan_multi`;
* :mod:`.replay`: :func:`~ntp_opt.workflows.multi.replay.replay`, a trace run
  with the re-planner and the baselines.
"""

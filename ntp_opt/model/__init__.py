"""The model layer: the job, the cluster topology, instances, plans, failures and file I/O.

Nothing here imports from the layers above (rules, planners, solve, workflows, app);
``make test`` checks it with import-linter (``.importlinter``).
"""

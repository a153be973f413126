"""Hypothesis profiles for the property tests (docs/testing.md), and the order in
which ``pytest -n 4 --dist loadfile`` hands test files to its workers.

``ci`` (the default) is quick and deterministic: few examples, derandomized,
no example database writes that could change later runs. ``thorough`` draws
many more examples for a local run::

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/property/test_properties.py
"""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# pytest-xdist workers start with SIGINT ignored, and a child process started
# with SIGINT ignored never raises KeyboardInterrupt: the Ctrl-C tests
# (test_control.py, test_hostile.py) need Python's default handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: Relative cost of the slowest test files: their CPU seconds (the test process and
#: its children) in one suite run (``-n 2 --dist loadfile``, 2026-12-03, session 22);
#: only the order matters. ``--dist loadfile`` gives a worker one whole file when it
#: runs short of work, in collection order; the longest files go first, so that the
#: short ones fill in at the end and the workers finish together (longest-first
#: scheduling). Other files keep their order after these. A stale figure only makes
#: the split less even.
FILE_COST = {
    "test_docs.py": 27,
    "test_milp.py": 20,
    "test_bounds_reference.py": 18,
    "test_bench.py": 17,
    "test_riskaware.py": 13,
    "test_service_limits.py": 13,
    "test_control.py": 12,
    "test_simulate.py": 10,
    "test_instances.py": 10,
    "test_power_limits.py": 10,
    "test_plot.py": 10,
    "test_export.py": 10,
    "test_properties.py": 9,
    "test_hostile.py": 9,
    "test_bench_ray.py": 8,
    "test_best_known.py": 4,
    "test_fast.py": 4,
    "test_service.py": 3,
    "test_papercuts.py": 3,
    "test_backends.py": 3,
}


def pytest_configure(config: pytest.Config) -> None:
    """Keep the collection order (below) as pytest-xdist's file order: by default
    ``--dist loadfile`` sorts files by their number of tests, which puts long files
    of few tests (the documentation pages, the properties) last."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (``FILE_COST``); the order inside a file is kept."""
    cost = {id(item): FILE_COST.get(item.path.name, 0) for item in items}
    items.sort(key=lambda item: -cost[id(item)])  # stable: a file's tests stay in order

"""What a command imports: ``ntp-opt solve --planner fast`` loads only the layers it runs.

Each check runs in a fresh interpreter (``sys.modules`` of this one holds
everything the other tests imported) and prints the modules it ended with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ntp_opt
from ntp_opt.app.cli import COMMANDS, build_parser

ROOT = Path(ntp_opt.__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SMALL = ROOT / "instances" / "nvl32-1k-0.1pct-fixed.json.gz"

#: Modules the ``fast`` path must not import (packages: any module under them).
NOT_ON_THE_FAST_PATH = (
    "networkx",
    "scipy",
    "matplotlib",
    "ortools",
    "pulp",
    "highspy",
    "ntp_opt.planners.exact.search",
    "ntp_opt.planners.exact.backends",
    "ntp_opt.planners.riskaware",
    "ntp_opt.planners.megatron",
    "ntp_opt.workflows",
    "ntp_opt.planners.multi",
    "ntp_opt.app.service",
    "ntp_opt.app.importers",
    *(m for name, m in COMMANDS.items() if name != "solve"),
)


def _modules_after(code: str) -> list[str]:
    """The modules loaded once ``code`` ran in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(json.dumps(sorted(sys.modules)))"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def _under(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_solve_fast_imports_only_what_it_runs(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    modules = _modules_after(
        "import json\n"
        "from ntp_opt.app.cli import main\n"
        f"assert main(['solve', {str(SMALL)!r}, '--planner', 'fast', '-o', {str(out)!r}]) == 0"
    )
    assert json.loads(out.read_text())["format"] == "ntp-opt/plan@1"
    # what it runs is there (the check below looks at the right process)
    assert {"ntp_opt.planners.fast", "ntp_opt.rules.validate", "ntp_opt.app.cli.solve"} <= set(
        modules
    )
    assert _under(modules, NOT_ON_THE_FAST_PATH) == []


def test_the_exact_search_is_imported_when_run() -> None:
    """The planners left out above are imported when a command runs them."""
    run = "import json\nfrom ntp_opt import load_instance, solve\n"
    modules = _modules_after(run + f"solve(load_instance({str(SMALL)!r}), 'dp-drop')")
    assert "ntp_opt.planners.fast" in modules  # the registry's own imports
    assert "ntp_opt.planners.exact.search" not in modules
    modules = _modules_after(
        run + "try:\n"
        f"    solve(load_instance({str(SMALL)!r}), 'optimal', time_limit=0.01)\n"
        "except ImportError:\n"
        "    pass  # the backend's extra is missing: the search module was imported first"
    )
    assert "ntp_opt.planners.exact.search" in modules


def test_import_ntp_opt_imports_no_layer() -> None:
    modules = _modules_after("import json, ntp_opt")
    assert _under(modules, ("ntp_opt.model", "ntp_opt.rules", "ntp_opt.solve", "numpy")) == []


def test_lazy_names_resolve_to_the_api() -> None:
    """Every name of ``__all__``, whatever was imported first (``ntp_opt.solve`` is a
    module too: the package keeps the function; the deprecated path
    ``ntp_opt.validate``: tests/test_old_paths.py)."""
    _modules_after(
        "import json, importlib, types, warnings\n"
        "warnings.filterwarnings('error', 'ntp_opt.* is deprecated', DeprecationWarning)\n"
        "import ntp_opt.solve, ntp_opt.workflows.replan\n"
        "import ntp_opt\n"
        "assert callable(ntp_opt.solve) and ntp_opt.solve.__name__ == 'solve'\n"
        "assert callable(ntp_opt.validate) and ntp_opt.validate.__name__ == 'validate'\n"
        "from ntp_opt import *\n"
        "for name in ntp_opt.__all__:\n"
        "    value = getattr(ntp_opt, name)\n"
        "    assert not isinstance(value, types.ModuleType) or name == 'topology', name\n"
        "    assert name in ('PLANNERS', 'topology') or value.__module__.startswith('ntp_opt.')\n"
        "assert Instance.__module__ == 'ntp_opt.model.instance' and topology.build\n"
        "assert Replanner.__module__ == 'ntp_opt.workflows.replan'\n"
        "assert set(ntp_opt.__all__) <= set(dir(ntp_opt))\n"
        "import ntp_opt.model.topology.build\n"
        "assert callable(ntp_opt.topology.build)\n"
    )
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ntp_opt.nope  # noqa: B018


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_s_parser_is_the_full_parser_s(command: str) -> None:
    """``ntp-opt COMMAND ...`` builds only COMMAND's parser: the same one."""
    full = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    only = build_parser(command)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    assert only.format_help() == full.format_help()
    assert list(build_parser()._subparsers._group_actions[0].choices) == list(COMMANDS)  # type: ignore[union-attr]

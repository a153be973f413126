"""The deprecated module paths (``ntp_opt.replan``, ``ntp_opt.milp.search``, ...).

Each still gives the very module of its layered home for one release, with a
``DeprecationWarning`` naming the new path, whether reached as an attribute
(``ntp_opt.replan``) or by ``import``; nothing in the repository uses them
(``pyproject.toml`` turns their warning into an error under pytest).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import pathlib
import re
import subprocess
import sys
import textwrap
import types
import warnings

import pytest

import ntp_opt

ROOT = pathlib.Path(ntp_opt.__file__).resolve().parent.parent

#: The modules that were files at these paths before the layers (written out
#: here, not read from the package's table).
OLD_TO_NEW = {
    "ntp_opt.bench": "ntp_opt.app.bench",
    "ntp_opt.cli": "ntp_opt.app.cli",
    "ntp_opt.control": "ntp_opt.model.control",
    "ntp_opt.expected": "ntp_opt.rules.expected",
    "ntp_opt.export": "ntp_opt.app.export",
    "ntp_opt.failures": "ntp_opt.model.failures",
    "ntp_opt.files": "ntp_opt.model.files",
    "ntp_opt.hardware": "ntp_opt.model.hardware",
    "ntp_opt.instance": "ntp_opt.model.instance",
    "ntp_opt.job": "ntp_opt.model.job",
    "ntp_opt.megatron": "ntp_opt.planners.megatron",
    "ntp_opt.plan": "ntp_opt.model.plan",
    "ntp_opt.plot": "ntp_opt.app.plotting",
    "ntp_opt.power": "ntp_opt.rules.power",
    "ntp_opt.recourse": "ntp_opt.rules.recourse",
    "ntp_opt.replan": "ntp_opt.workflows.replan",
    "ntp_opt.riskaware": "ntp_opt.planners.riskaware",
    "ntp_opt.safeio": "ntp_opt.model.safeio",
    "ntp_opt.service": "ntp_opt.app.service",
    "ntp_opt.simulate": "ntp_opt.workflows.simulate",
    "ntp_opt.topology": "ntp_opt.model.topology",
    "ntp_opt.validate": "ntp_opt.rules.validate",
    "ntp_opt.importers": "ntp_opt.app.importers",
    "ntp_opt.importers.cli": "ntp_opt.app.importers.cli",
    "ntp_opt.importers.compose": "ntp_opt.app.importers.compose",
    "ntp_opt.importers.hostlist": "ntp_opt.app.importers.hostlist",
    "ntp_opt.importers.k8s": "ntp_opt.app.importers.k8s",
    "ntp_opt.importers.nvidia_smi": "ntp_opt.app.importers.nvidia_smi",
    "ntp_opt.importers.slurm": "ntp_opt.app.importers.slurm",
    "ntp_opt.milp": "ntp_opt.planners.exact",
    "ntp_opt.milp.backends": "ntp_opt.planners.exact.backends",
    "ntp_opt.milp.model": "ntp_opt.planners.exact.model",
    "ntp_opt.milp.program": "ntp_opt.planners.exact.program",
    "ntp_opt.milp.search": "ntp_opt.planners.exact.search",
}

#: Old names that are also public names of the package (``__all__``).
PUBLIC = {"topology", "validate"}


def _deprecation(old: str, new: str) -> str:
    return re.escape(old) + r" is deprecated .*; use " + re.escape(new) + "$"


def _ours(seen: pytest.WarningsRecorder) -> list[warnings.WarningMessage]:
    return [w for w in seen if "is deprecated and goes in the next release" in str(w.message)]


def test_the_old_files_are_gone() -> None:
    package = ROOT / "ntp_opt"
    for old in OLD_TO_NEW:
        path = package.joinpath(*old.split(".")[1:])
        assert not path.with_suffix(".py").exists() and not path.is_dir(), old


@pytest.mark.parametrize("old", list(OLD_TO_NEW))
def test_import_of_an_old_path_is_the_new_module_and_warns(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = OLD_TO_NEW[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # an earlier test's import
    with pytest.warns(DeprecationWarning, match=_deprecation(old, new)) as seen:
        __import__(old)  # as an ``import`` statement does
    module = sys.modules[old]
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__ is not None
    assert module.__spec__.name == new  # its own spec, not the alias's
    assert {w.filename for w in _ours(seen)} == {__file__}  # the warning names the importer


def test_from_import_and_patching_go_through_the_new_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "ntp_opt.milp.search", raising=False)
    with pytest.warns(DeprecationWarning, match="ntp_opt.milp.search is deprecated"):
        from ntp_opt.milp.search import solve_exact
    from ntp_opt.planners.exact import search

    assert solve_exact is search.solve_exact
    monkeypatch.setattr(sys.modules["ntp_opt.milp.search"], "solve_exact", None)
    assert search.solve_exact is None


@pytest.mark.parametrize("name", sorted({o.split(".")[1] for o in OLD_TO_NEW} - PUBLIC))
def test_an_old_module_attribute_warns(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = OLD_TO_NEW[f"ntp_opt.{name}"]
    # bound by an earlier import; vars() so that removing it does not call __getattr__
    monkeypatch.delitem(vars(ntp_opt), name, raising=False)
    with pytest.warns(DeprecationWarning, match=_deprecation(f"ntp_opt.{name}", new)) as seen:
        value = getattr(ntp_opt, name)
    assert value is importlib.import_module(new)
    assert [w.filename for w in _ours(seen)] == [__file__]


def test_the_public_names_do_not_warn_and_validate_stays_the_function(
    recwarn: pytest.WarningsRecorder,
) -> None:
    assert ntp_opt.topology is importlib.import_module("ntp_opt.model.topology")
    assert isinstance(ntp_opt.validate, types.FunctionType)
    assert ntp_opt.validate.__module__ == "ntp_opt.rules.validate"
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]

    sys.modules.pop("ntp_opt.validate", None)
    with pytest.warns(DeprecationWarning, match="ntp_opt.validate is deprecated"):
        __import__("ntp_opt.validate")  # ``import ntp_opt.validate``: the old module path
    assert sys.modules["ntp_opt.validate"] is importlib.import_module("ntp_opt.rules.validate")
    assert isinstance(ntp_opt.validate, types.FunctionType)  # not rebound to the module


def test_under_pytest_an_old_path_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``filterwarnings`` of ``pyproject.toml``: a use left anywhere fails its test."""
    monkeypatch.delitem(sys.modules, "ntp_opt.replan", raising=False)
    monkeypatch.delitem(vars(ntp_opt), "replan", raising=False)
    with pytest.raises(DeprecationWarning, match=r"ntp_opt\.replan is deprecated"):
        importlib.import_module("ntp_opt.replan")
    with pytest.raises(DeprecationWarning, match=r"ntp_opt\.replan is deprecated"):
        ntp_opt.replan  # noqa: B018


def test_an_unknown_name_is_still_an_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ntp_opt.nope  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ntp_opt.nope")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ntp_opt.milp.nope")


@pytest.mark.parametrize("module", ["ntp_opt", "ntp_opt.cli"])
def test_python_m_runs_the_command_line(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "default::DeprecationWarning", "-m", module, "--help"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: ntp-opt"), done.stderr
    # the old path runs too, and says so
    assert ("ntp_opt.cli is deprecated" in done.stderr) == (module == "ntp_opt.cli")


def _old_imports(tree: ast.AST, where: str, line: int = 0) -> list[str]:
    """The old paths ``tree`` imports, also in code held in its strings (a child's)."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]  # ``from ntp_opt import replan`` is an old path too:
            if node.module == "ntp_opt":
                names += [f"ntp_opt.{a.name}" for a in node.names if a.name not in PUBLIC]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            with contextlib.suppress(SyntaxError, ValueError):
                code = ast.parse(textwrap.dedent(node.value))
                found += _old_imports(code, where, line or node.lineno)
        at = line or getattr(node, "lineno", 0)
        found += [f"{where}:{at}: {n}" for n in names if n in OLD_TO_NEW]
    return found


def test_nothing_in_the_repository_imports_an_old_path() -> None:
    files = [
        *(ROOT / "ntp_opt").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        ROOT / "instances" / "generate.py",
    ]
    found = []
    for path in files:
        if path != pathlib.Path(__file__):
            text = path.read_text(encoding="utf-8")
            found += _old_imports(ast.parse(text), str(path.relative_to(ROOT)))
    assert not found, "old module paths imported:\n" + "\n".join(found)

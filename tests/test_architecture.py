"""The package's layers: import-linter's contracts, no private names across modules, no cycles."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

import ntp_opt

PACKAGE = pathlib.Path(ntp_opt.__file__).parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every ``from ... import`` in a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
    return found


def test_import_linter_contracts_hold() -> None:
    """``lint-imports`` (the layers and solvers contracts of ``.importlinter``)."""
    exe = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).parent / "lint-imports")
    if not pathlib.Path(exe).exists():
        pytest.fail("import-linter is not installed: pip install -e '.[dev]'")
    done = subprocess.run(
        [exe, "--config", str(ROOT / ".importlinter")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


#: Solver packages, and the one package allowed to import them.
SOLVERS = ("highspy", "ortools", "pulp")
BACKENDS = "ntp_opt.planners.exact.backends"


def test_solver_packages_are_imported_only_by_the_backends() -> None:
    """The ``solvers`` contract, checked on the source (lazy imports included)."""
    outside = [
        f"{name}:{line} imports {module}"
        for name, path in _modules().items()
        if name != BACKENDS and not name.startswith(BACKENDS + ".")
        for module, _, line in _imports(name, path)
        if module.split(".")[0] in SOLVERS
    ]
    assert outside == []


def test_no_private_name_is_imported_from_another_module() -> None:
    """``from x import _name`` only inside one module's own package ``__init__`` re-exports."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for module, names, line in _imports(name, path):
            if not module.startswith("ntp_opt") or module == name:
                continue
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {module}.{imported}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules() -> None:
    """The module graph (every import, also inside functions) is acyclic."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names, _ in _imports(name, path):
            targets = [module] + [f"{module}.{n}" for n in names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    # a package's __init__ importing its own submodules is not a cycle of behaviour
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)

"""Every fenced ``python`` and ``sh`` block of README.md and docs/*.md runs.

Per page, the blocks run in document order in a fresh temporary folder that
holds a copy of ``instances/``, with ``ntp-opt`` and ``python`` (this tree's
code) first on ``PATH``. The page's ``python`` blocks share one namespace
(fresh per page); a block marked ``<!-- doc-test: setup -->`` runs first.
``sh`` blocks run under ``bash -euo pipefail``.

Directives, HTML comments on the lines just above a fence (invisible on
GitHub; several may be stacked):

- ``<!-- doc-test: skip REASON -->``: not run (a reason is required);
- ``<!-- doc-test: setup -->``: a python block the page's other blocks need;
- ``<!-- doc-test: sub OLD => NEW -->``: run the block with ``OLD`` replaced
  by ``NEW`` (a smaller input for a long example; ``OLD`` must occur);
- ``<!-- doc-test: server -->``: start ``ntp-opt serve`` on a free port
  first (once per page; stopped after the page) and run the block with
  ``8000`` replaced by that port;
- ``<!-- doc-test: output -->`` above a ``text`` block: that block is the
  exact stdout of the code block before it (``...`` inside a line matches
  anything; a line holding only ``...`` matches any number of lines).

Quoted output without ``output`` must be labelled as an example in the prose.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.warm_cli import SOCKET_ENV

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = ("python", "sh")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    setup: bool = False
    server: bool = False
    subs: list[tuple[str, str]] = field(default_factory=list)
    output: Block | None = None  # the asserted text block that follows


def parse(path: Path, rel: str | None = None) -> list[Block]:
    """The fenced blocks of a page, with their directives."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = rel or path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        indent, lang = m.group("indent"), m.group("lang")
        body = []
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != indent + "```":
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        if j == len(lines):
            raise AssertionError(f"{rel}:{i + 1}: unclosed ``` block")
        block = Block(rel, i + 1, lang, "\n".join(body) + "\n")
        k = i - 1
        directives = []
        while k >= 0 and (d := _DIRECTIVE.match(lines[k])):
            directives.append(d.group("body"))
            k -= 1
        for d in directives:
            word, _, rest = d.partition(" ")
            if word == "skip":
                assert rest.strip(), f"{rel}:{i + 1}: doc-test: skip needs a reason"
                block.skip = rest.strip()
            elif word == "setup":
                block.setup = True
            elif word == "server":
                block.server = True
            elif word == "sub":
                sub = re.fullmatch(r"(.+?) =>(?: (.*))?", rest)
                assert sub, f"{rel}:{i + 1}: doc-test: sub OLD => NEW"
                old, new = sub.group(1), sub.group(2) or ""
                assert old in block.code, f"{rel}:{i + 1}: {old!r} is not in the block"
                block.subs.append((old, new))
            elif word == "output":
                assert lang == "text", f"{rel}:{i + 1}: doc-test: output marks a text block"
                runnable = [b for b in blocks if b.lang in RUN_LANGS]
                assert runnable, f"{rel}:{i + 1}: no code block before the output"
                runnable[-1].output = block
            else:
                raise AssertionError(f"{rel}:{i + 1}: unknown directive doc-test: {d}")
        blocks.append(block)
        i = j + 1
    return blocks


ALL = {p.relative_to(ROOT).as_posix(): parse(p) for p in PAGES}
RUNNABLE = {page: [b for b in bs if b.lang in RUN_LANGS] for page, bs in ALL.items()}
RAN: list[Block] = []


def _matches(expected: str, actual: str) -> bool:
    parts = []
    for line in expected.rstrip("\n").split("\n"):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    return re.fullmatch("".join(parts), actual.rstrip("\n") + "\n", re.S) is not None


@pytest.fixture(scope="module")
def warm_cli() -> Iterator[str]:
    """The warm ``ntp-opt`` server (tests/warm_cli.py) for the page's shell blocks:
    its socket path. Each command still runs in a process of its own."""
    folder = Path(tempfile.mkdtemp(prefix="ntp-warm-"))  # short: a Unix socket path
    sock = str(folder / "cli.sock")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "warm_cli.py"), "--warm-serve", sock],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # waits for the event, not a clock
    try:
        yield sock
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def workdir(tmp_path, monkeypatch, warm_cli):
    """A folder with a copy of instances/, ntp-opt and python on PATH."""
    shutil.copytree(ROOT / "instances", tmp_path / "instances")
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    venv_bin = tmp_path / ".venv" / "bin"  # the docs say .venv/bin/python (make install)
    venv_bin.mkdir(parents=True)
    warm = f'-S "{ROOT / "tests" / "warm_cli.py"}"'  # a bare client of the warm server
    for folder, name, cmd in (
        (bin_dir, "ntp-opt", warm),
        (bin_dir, "python", ""),
        (bin_dir, "python3", ""),
        (venv_bin, "python", ""),
    ):
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {cmd} "$@"\n')
        shim.chmod(0o755)
    monkeypatch.setenv(SOCKET_ENV, warm_cli)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run_python(block: Block, code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{block.page}:{block.line}", "exec"), namespace)
    return out.getvalue()


def _run_sh(block: Block, code: str, cwd: Path) -> str:
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,  # a hang guard only; nothing is asserted on time
    )
    assert proc.returncode == 0, (
        f"{block.page}:{block.line}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}"
    )
    return proc.stdout


class _Server:
    """``ntp-opt serve`` on a free loopback port, for blocks marked ``server``."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        cmd = [sys.executable, "-m", "ntp_opt.app.cli", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stderr is not None
        seen = []
        for line in self.proc.stderr:  # wait for uvicorn's start line (no clock)
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        else:
            self.proc.wait()
            raise AssertionError("ntp-opt serve did not start:\n" + "".join(seen))
        # keep draining its log so that the server never blocks on a full pipe
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


@pytest.mark.parametrize("page", [p for p, bs in RUNNABLE.items() if bs])
def test_page_blocks_run(page, workdir):
    blocks = RUNNABLE[page]
    order = [b for b in blocks if b.setup] + [b for b in blocks if not b.setup]
    namespace: dict = {"__name__": "__doc_test__"}
    server: _Server | None = None
    try:
        for block in order:
            if block.skip:
                continue
            code = block.code
            for old, new in block.subs:
                code = code.replace(old, new)
            if block.server:
                server = server or _Server()
                code = code.replace("8000", str(server.port))
            if block.lang == "python":
                out = _run_python(block, code, namespace)
            else:
                out = _run_sh(block, code, workdir)
            if block.output is not None:
                assert _matches(block.output.code, out), (
                    f"{block.page}:{block.line}: output differs from the quote at line "
                    f"{block.output.line}:\n--- quoted\n{block.output.code}--- actual\n{out}"
                )
            RAN.append(block)
    finally:
        if server is not None:
            server.stop()


def test_every_block_ran_or_is_skipped_with_a_reason(capsys):
    """The count of blocks run: all of them, except those skipped with a reason."""
    blocks = [b for bs in RUNNABLE.values() for b in bs]
    skipped = [b for b in blocks if b.skip]
    to_run = len(blocks) - len(skipped)
    assert to_run > 0
    pages_run = {b.page for b in RAN}
    pages_wanted = {b.page for b in blocks if not b.skip}
    if pages_run != pages_wanted:
        pytest.skip(f"only {len(pages_run)} of {len(pages_wanted)} pages ran (selection)")
    by_lang = {lang: sum(1 for b in RAN if b.lang == lang) for lang in RUN_LANGS}
    lines = [
        f"doc blocks: ran {len(RAN)} of {len(blocks)} python/sh blocks in {len(ALL)} pages "
        f"({', '.join(f'{n} {lang}' for lang, n in by_lang.items())}); "
        f"{len(skipped)} skipped with a reason:",
        *(f"  {b.page}:{b.line}: {b.skip}" for b in skipped),
    ]
    with capsys.disabled():  # shown in every run, not only with -s
        print("\n" + "\n".join(lines))
    assert len(RAN) == to_run


def test_output_matcher():
    assert _matches("a 1\nb ...\n", "a 1\nb 2.5 x\n")
    assert _matches("a\n...\nz\n", "a\nb\nc\nz\n")
    assert _matches("a\n...\nz\n", "a\nz\n")
    assert not _matches("a 1\n", "a 2\n")
    assert not _matches("a\n", "a\nb\n")


def test_parser_directives(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- doc-test: skip too slow -->\n```sh\nsleep 1000\n```\n"
        "<!-- doc-test: setup -->\n```python\nx = 1\n```\n"
        '<!-- doc-test: sub "a" => "b" -->\n```python\nprint("a")\n```\n'
        "<!-- doc-test: output -->\n```text\nb\n```\n"
        "- item\n\n  ```sh\n  echo hi\n  ```\n"
    )
    blocks = parse(page, "p.md")
    assert [b.lang for b in blocks] == ["sh", "python", "python", "text", "sh"]
    assert blocks[0].skip == "too slow" and blocks[1].setup
    assert blocks[2].subs == [('"a"', '"b"')] and blocks[2].output is blocks[3]
    assert blocks[4].code == "echo hi\n"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path: Path) -> list[str]:
    """The anchors of a page's headings (``#`` lines outside fences), in order."""
    found: list[str] = []
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug_ = slug(m.group(1))
            n = seen.get(slug_, 0)
            seen[slug_] = n + 1
            found.append(slug_ if n == 0 else f"{slug_}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The relative link targets of a page (not in code blocks or inline code)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_anchors_follow_github(tmp_path):
    assert slug("Job (spec section 2) — `ntp_opt/model/job.py`") == (
        "job-spec-section-2--ntp_optmodeljobpy"  # brackets, backticks, the dash, dots and / go
    )
    assert slug("The wait-and-see bound: θ′ and ρ") == "the-wait-and-see-bound-θ-and-ρ"
    page = tmp_path / "p.md"
    page.write_text("# A\n```sh\n# not a heading\n```\n## A\n### B ##\n")
    assert anchors(page) == ["a", "a-1", "b"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    """Every relative link names a file that exists, and its #anchor a heading there."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_index_lists_every_page():
    """docs/index.md has a line for every other page of docs/."""
    index = ROOT / "docs" / "index.md"
    listed = {Path(t.partition("#")[0]).name for t in links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md lacks {sorted(pages - listed)}"
    assert "docs/index.md" in links(ROOT / "README.md")

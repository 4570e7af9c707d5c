"""Every fenced code block in README.md and docs/*.md is run here, or says why not.

A block is marked by an HTML comment on the line before its fence (a reader
of the rendered page does not see it):

``<!-- test: python against A B ... -->``
    run the block with this interpreter in a subprocess, each address ``A``,
    ``B``, ... replaced by the address of a real pool server started for it
    (:func:`kvfabric.testing.servers.start_pool`, random loopback ports);
``<!-- test: sh against A B ... -->``
    run the block with ``bash -e``, this environment's ``kvfabric`` first on
    ``PATH``, the addresses replaced the same way (``sh`` alone: no servers);
``<!-- test: serve -->``
    every line is a ``kvfabric serve`` command: each is run as written with
    ``--print-config`` appended, which parses every flag and value (sizes,
    policies, paths, etcd settings) and exits, without taking the reader's
    fixed ports or 4 GiB arenas here;
``<!-- test: skip: REASON -->``
    not run here, and the reason says why (an engine that lives in its own
    test part, the test suite itself, a fragment).

A ```` ```text ```` block is a diagram or an output: there is nothing to
run. Any other fenced block without a marker fails this test, so a new
snippet cannot go untested unnoticed. Indented blocks are quoted benchmark
commands (the benchmarks' smoke tests run those). No timing is asserted.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfabric.testing.servers import start_pool

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*test:\s*(?P<kind>python|sh|serve|skip)\b(?P<rest>.*?)-->\s*$")
#: a block's subprocess gets this long; a hang fails with its output instead of stalling the suite
RUN_TIMEOUT_S = 120


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str | None  # python | sh | serve | skip | None (unmarked)
    rest: str  # the marker's arguments: "against A B" or the skip reason

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def addresses(self) -> list[str]:
        words = self.rest.split()
        return words[1:] if words[:1] == ["against"] else []


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the marker on the line before its fence."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            m = MARK.match(lines[i - 1].strip()) if i else None
            out.append(Block(path, i + 1, lang, "\n".join(lines[i + 1:j]) + "\n",
                             m["kind"] if m else None, m["rest"].strip() if m else ""))
            i = j + 1
        else:
            i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]


def test_the_documents_have_blocks_to_check():
    assert any(b.kind == "python" for b in ALL) and any(b.kind == "serve" for b in ALL), [b.where for b in ALL]


@pytest.mark.parametrize("block", [b for b in ALL if b.lang != "text"], ids=lambda b: b.where)
def test_every_block_is_marked(block: Block):
    assert block.kind is not None, (
        f"{block.where}: a ```{block.lang} block without a '<!-- test: ... -->' line before its fence; mark it "
        f"python/sh/serve to have it run here, or 'skip: REASON' (see this test's docstring):\n{block.code}")
    if block.kind == "skip":
        assert block.rest.lstrip(":").strip(), f"{block.where}: 'skip' needs a reason after it"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    for k in [k for k in env if k.startswith("KVFABRIC_")]:  # the snippet says what it uses
        del env[k]
    return env


def _run(cmd: list[str], block: Block, what: str) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=ROOT)
    assert p.returncode == 0, (f"{block.where}: {what} exited {p.returncode}\n--- block as run:\n{cmd[-1]}\n"
                               f"--- stdout:\n{p.stdout}\n--- stderr:\n{p.stderr}")
    return p


@pytest.mark.parametrize("block", [b for b in ALL if b.kind in ("python", "sh")], ids=lambda b: b.where)
def test_block_runs_against_real_servers(block: Block):
    wanted = block.addresses()
    # room for the README client snippet's three 32 MiB blocks on either server
    with start_pool(len(wanted), capacity="160MiB") if wanted else _no_pool() as pool:
        code = block.code
        for doc_addr, real in zip(wanted, pool.addresses if wanted else []):
            assert doc_addr in code, f"{block.where}: the marker names {doc_addr}, the block does not"
            code = code.replace(doc_addr, real)
        if block.kind == "python":
            p = _run([sys.executable, "-c", code], block, "the python block")
        else:
            p = _run(["bash", "-e", "-o", "pipefail", "-c", code], block, "the sh block")
    if block.kind == "python" and "blocks hit" in block.code:  # the README's client snippet
        assert p.stdout.startswith("0 blocks hit;"), f"{block.where}: a fresh pool holds nothing:\n{p.stdout}"
    if "kvfabric stats" in block.code and wanted:
        for real in pool.addresses:
            assert real in p.stdout, f"{block.where}: no row for {real}:\n{p.stdout}"


class _no_pool:
    addresses: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "serve"], ids=lambda b: b.where)
def test_serve_lines_parse_as_written(block: Block):
    lines = [ln.split("#", 1)[0].strip() for ln in block.code.splitlines()]
    lines = [ln for ln in lines if ln]
    assert lines, f"{block.where}: an empty serve block"
    for ln in lines:
        argv = shlex.split(ln)
        assert argv[:2] == ["kvfabric", "serve"], f"{block.where}: not a kvfabric serve line: {ln!r}"
        p = _run([sys.executable, "-m", "kvfabric", "serve", *argv[2:], "--print-config"], block, ln)
        assert p.stdout.strip(), f"{block.where}: --print-config printed nothing for {ln!r}"

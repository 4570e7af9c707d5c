#!/usr/bin/env python3
"""The C files' call graph, and whether it has a cycle: the check that keeps csrc/ layered.

Each csrc/*.c is compiled on its own (gcc -c, the extension's include paths) into a temporary
folder and read with `nm`: a file that uses a symbol another file defines (a call, or a table
it names) points at that file. The files must form layers: a cycle between files (a calls b
and b, directly or through others, calls a) is what this refuses, printing each cycle with the
symbols on its edges. Calls through function pointers are not seen (they are how a lower layer
hands work back without naming the layer above).

    python3 scripts/c-layers.py            # exit 0: no cycle (prints the layers, top first)
    python3 scripts/c-layers.py --edges    # also every file-to-file edge with its symbols

tests/unit/test_c_layers.py runs it in CI.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def compile_all(csrc: Path, out_dir: Path) -> dict[str, Path]:
    """Every csrc/*.c (not third_party/) compiled to out_dir; name -> object file."""
    include = sysconfig.get_paths()["include"]
    cmds = {}
    for src in sorted(csrc.glob("*.c")):
        obj = out_dir / (src.stem + ".o")
        cmds[src.stem] = (obj, ["gcc", "-c", "-O0", "-w", f"-I{csrc}", f"-I{csrc / 'third_party' / 'xxhash'}",
                                f"-I{include}", "-DKVF_XXH_DISPATCH=1", str(src), "-o", str(obj)])

    def build(item):
        name, (obj, cmd) = item
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"c-layers: {name}.c does not compile:\n{r.stderr}")
        return name, obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(pool.map(build, cmds.items()))


def symbol_graph(objects: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """file -> {file it uses -> the symbols it uses there}."""
    defined: dict[str, str] = {}
    used: dict[str, set[str]] = collections.defaultdict(set)
    for name, obj in objects.items():
        out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRC":
                defined[parts[2]] = name
            elif len(parts) == 2 and parts[0] == "U":
                used[name].add(parts[1])
    graph: dict[str, dict[str, set[str]]] = {name: collections.defaultdict(set) for name in objects}
    for name, syms in used.items():
        for sym in syms:
            owner = defined.get(sym)
            if owner and owner != name:
                graph[name][owner].add(sym)
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layers(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Files by depth, top first: a file sits above every file it uses (graph must be acyclic)."""
    depth: dict[str, int] = {}

    def height(v: str) -> int:
        if v not in depth:
            depth[v] = 1 + max((height(w) for w in graph[v]), default=-1)
        return depth[v]

    for v in graph:
        height(v)
    by: dict[int, list[str]] = collections.defaultdict(list)
    for v, d in depth.items():
        by[d].append(v)
    return [sorted(by[d]) for d in sorted(by, reverse=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", action="store_true", help="print every file-to-file edge with its symbols")
    ap.add_argument("--csrc", type=Path, default=CSRC, help="the folder of C files (default: csrc/)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvf-c-layers-") as tmp:
        graph = symbol_graph(compile_all(args.csrc, Path(tmp)))
    if args.edges:
        for a in sorted(graph):
            for b in sorted(graph[a]):
                print(f"{a}.c -> {b}.c: {', '.join(sorted(graph[a][b]))}")
    bad = cycles(graph)
    if bad:
        print(f"c-layers: {len(bad)} call cycle(s) between C files (calls must go one way):")
        for comp in bad:
            print(f"  cycle: {' '.join(f + '.c' for f in comp)}")
            members = set(comp)
            for a in comp:
                for b in sorted(graph[a]):
                    if b in members:
                        print(f"    {a}.c -> {b}.c: {', '.join(sorted(graph[a][b]))}")
        return 1
    print(f"c-layers: {len(graph)} C files, no call cycle; layers, top first:")
    for i, files in enumerate(layers(graph)):
        print(f"  {i:2d}  {' '.join(f + '.c' for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

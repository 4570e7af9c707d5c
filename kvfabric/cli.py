"""The ``kvfabric`` command: ``serve``, ``stats``, ``top``, ``cluster ls``, ``ping``, ``exists``, ``get``,
``put``, ``del``, ``bench <name>``, ``--version``.

Each command's module is imported only when it runs (``serve``:
``kvfabric/server/main.py``; ``stats``/``top``: ``kvfabric/tools/stats.py``;
``cluster``: ``tools/cluster.py``; ``ping`` ... ``del``: ``tools/admin.py``).

``bench <name>`` imports ``kvfabric.bench.<name>`` lazily and calls its
``main(argv)`` with the remaining arguments, so a new benchmark is added by
dropping a module into ``kvfabric/bench/``; nothing here changes. ``bench
--help`` lists each with the first line of its module docstring, read from
the source (``ast``) without importing it. An unknown name is an error that
lists the benchmark modules found.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys

USAGE = """usage: kvfabric <command> [args...]

commands:
  serve [options]        run a pool server (kvfabric serve --help)
  stats [ADDR...]        one table of every server's STATS (--json for all of it)
  top [ADDR...]          the same, refreshed every second, with GB/s and hits/s
  cluster ls [--etcd URL] [--cluster NAME]
                         members registered in etcd, their state and stats (--json)
  ping [ADDR...]         round trip, server id, version and transport of each server
  exists [ADDR] KEY...   is each key held (--size: and its size, by fetching it)
  get [ADDR] KEY         the value to stdout (-o FILE: to a file)
  put [ADDR] KEY         store stdin (-i FILE: a file) under KEY; never overwrites
  del [ADDR] KEY...      delete keys
  bench <name> [args]    run a benchmark (kvfabric bench --help lists them)
  route [options]        OpenAI-compatible router in front of vLLM instances: each request
                         where its KV is cheapest; --mode pd for prefill/decode (route --help)
  --version              print the version

ADDR: HOST:PORT[,HOST:PORT...], default $KVFABRIC_SERVERS (the client's
variables apply: KVFABRIC_AUTH_TOKEN, KVFABRIC_TIMEOUT_S, ...). KEY: hex,
1..64 bytes. Options of every client tool: --token, --token-file, --timeout,
-v (COMMAND --help). Errors are one line on stderr. Exit status: 0 done,
1 runtime failure (auth refused, connection refused, timeout), 2 bad
arguments, 3 key not found (get, exists).
"""


def bench_modules() -> list[str]:
    """Names of the modules in ``kvfabric.bench`` (each one a ``kvfabric bench <name>``)."""
    try:
        pkg = importlib.import_module("kvfabric.bench")
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def bench_summary(name: str) -> str:
    """The first line of ``kvfabric.bench.<name>``'s module docstring, parsed from its source without
    importing the module (its imports can be heavy: numpy, an engine); "" when it has none."""
    try:
        spec = importlib.util.find_spec(f"kvfabric.bench.{name}")
        if spec is None or spec.origin is None:
            return ""
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read(), spec.origin))
    except (OSError, SyntaxError, ImportError, ValueError):
        return ""
    return summary_line(doc or "", f"kvfabric bench {name}")


def summary_line(doc: str, command: str, width: int = 100) -> str:
    """A docstring's first paragraph as one line of at most ``width`` characters (cut at a word, "..."),
    without a leading ``command``: label or reST backquotes."""
    text = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    for label in (command, command.replace("_", "-")):
        if text.startswith(label):
            rest = text[len(label):].lstrip()
            if rest.startswith(":"):
                text = rest[1:].lstrip()
                break
            if rest.split(" ", 1)[0].isupper() and ":" in rest:  # "kvfabric bench replay TRACE: ..."
                text = rest.split(":", 1)[1].lstrip()
                break
    text = text[:1].upper() + text[1:]
    if len(text) > width:
        text = text[: width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return text


def bench_help(found: list[str]) -> str:
    """``kvfabric bench --help``: one line per benchmark, its name and what it does."""
    if not found:
        return "usage: kvfabric bench <name> [args...]\nbenchmarks: (none installed)\n"
    width = max(len(n) for n in found)
    lines = [f"  {n.ljust(width)}  {bench_summary(n)}".rstrip() for n in found]
    return ("usage: kvfabric bench <name> [args...]   (kvfabric bench <name> --help: its options)\n\nbenchmarks:\n"
            + "\n".join(lines) + "\n")


def _bench(argv: list[str]) -> int:
    found = bench_modules()
    listing = ", ".join(found) if found else "(none installed)"
    if not argv or argv[0] in ("-h", "--help"):
        print(bench_help(found), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    if name not in found:
        print(f"kvfabric bench: unknown benchmark {name!r}; available: {listing}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvfabric.bench.{name}")
    rc = module.main(argv[1:])
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("--version", "-V", "version"):
        from . import __version__
        from .protocol import VERSION

        print(f"kvfabric {__version__} (wire protocol {VERSION})")
        return 0
    if command in ("stats", "top"):
        from .tools import stats as tool

        return tool.stats_main(rest) if command == "stats" else tool.top_main(rest)
    if command == "cluster":
        from .tools import cluster

        return cluster.main(rest)
    if command in ("ping", "exists", "get", "put", "del"):
        from .tools import admin

        return admin.main(command, rest)
    if command == "serve":
        from .server.main import main as serve_main

        return serve_main(rest)
    if command == "bench":
        return _bench(rest)
    if command == "route":
        from .route.server import main as route_main

        return route_main(rest)
    print(f"kvfabric: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``kvfabric ping|exists|get|put|del [ADDR] KEY...``: one server or key at a time, from the shell.

Each command builds one :class:`kvfabric.Client` the way an engine does
(``kvfabric/tools/connect.py``: ``--token``/``--token-file``, ``--timeout``,
``--transport`` over the ``KVFABRIC_*`` variables), so keys route to the
same owner servers, auth and transports work as for an engine, and a
value's checksum is computed on put and verified on get.

``ADDR`` is ``HOST:PORT`` or a comma-separated list of them (every server of
the pool, as the engine lists them: a key is asked of its owner); it may be
left out when ``KVFABRIC_SERVERS`` is set. A first argument with a ``:`` is
the address, so a key is never mistaken for one. Keys are hex strings of 1..64
bytes (the wire's ``MAX_KEY_BYTES``; a block key is 32 hex digits with the
default ``xxh3_128``, 64 with ``blake3`` or ``sha256``), an optional ``0x``
prefix allowed.

* ``ping [ADDR...]``: one PING to every server: its round trip (the PING
  alone, after connect and HELLO), server id, server version, wire protocol
  and the transport used.
* ``exists [ADDR] KEY...``: ``KEY present`` or ``KEY absent`` per key. The
  EXISTS reply carries presence only (LOOKUP only a count); ``--size`` adds
  each present object's size in bytes by fetching it (a GET: its bytes do
  cross the network, one key at a time).
* ``get [ADDR] KEY [-o FILE]``: the value, byte for byte, to stdout or FILE
  (written only when the value arrived and matched its checksum).
* ``put [ADDR] KEY [-i FILE]``: store stdin (or FILE) under KEY. A key that is
  already held keeps its first value (a put never overwrites; ``del`` it
  first); that is said, exit 0.
* ``del [ADDR] KEY...``: delete; prints how many stored objects were removed
  (a key on two replicas counts twice; an absent key is not an error).

A miss is told apart from a failure: when a key comes back absent the tool
asks the client which of that key's owners failed during the call (marked
down, ran past the deadline, answered an error) and reports those instead.
Exit status: 0 done, 1 a server failed (one line each on stderr, e.g.
``kvfabric get: 127.0.0.1:7070: authentication failed (wrong or missing
--token)``), 2 bad arguments, 3 a key was not found (``get``, ``exists``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, TextIO

from .. import protocol
from ..client import Client
from ..config import ClientConfig
from .connect import (FAILED, NOT_FOUND, OK, USAGE, ToolError, add_options, addresses, client_config, describe,
                      open_client, quiet_logs, run)
from .stats import format_table

COMMANDS = ("ping", "exists", "get", "put", "del")
PING_COLUMNS = ("server", "server_id", "version", "protocol", "transport", "rtt ms")

_HEX = re.compile(r"[0-9a-fA-F]+")
_KEY_HINT = (f"keys are 1..{protocol.MAX_KEY_BYTES} bytes written in hex; a block key is 32 hex digits "
             "(xxh3_128) or 64 (blake3, sha256)")


def parse_key(text: str) -> bytes:
    """``"00ff..."`` (or ``"0x00ff..."``) -> the key's bytes; ToolError (status 2) naming what is wrong."""
    digits = text[2:] if text[:2] in ("0x", "0X") else text
    if not digits or not _HEX.fullmatch(digits):
        raise ToolError(f"bad key {text!r}: not a hex string ({_KEY_HINT})", USAGE)
    if len(digits) % 2:
        raise ToolError(f"bad key {text!r}: odd number of hex digits ({len(digits)}; {_KEY_HINT})", USAGE)
    if len(digits) // 2 > protocol.MAX_KEY_BYTES:
        raise ToolError(f"bad key {text!r}: {len(digits) // 2} bytes ({_KEY_HINT})", USAGE)
    return bytes.fromhex(digits)


def split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[ADDR] KEY...`` -> (addresses, keys): the first argument is the address list when it has a ``:``."""
    if args and ":" in args[0]:
        return addresses(args[:1]), list(args[1:])
    return [], list(args)


def failures(client: Client, keys: Sequence[bytes], timeout_s: float) -> list[str]:
    """Why ``keys`` came back absent, when it was not a miss: one line per owner server that failed
    during the call (``ADDRESS: what happened``), or a line for failures that marked nothing down
    (a BUSY or other error answer, a checksum mismatch). Empty: the servers answered, a true miss."""
    snap = client.stats(timeout_s=timeout_s)["client"]
    owners = {sid for row in client.route(list(keys)) for sid in row}
    if not owners:
        return ["no servers in the cluster"]
    lines = [f"{address}: {describe(st['last_error'] or 'unreachable', timeout_s)}"
             for address, st in snap["shards"].items() if not st["up"] and st["route_id"] in owners]
    if not lines and snap["checksum_failures"]:
        lines = ["the bytes received did not match their checksum (a corrupt copy; counted as a miss)"]
    if not lines and (snap["timeouts"] or snap["shard_errors"]):
        lines = [f"{snap['shard_errors'] + snap['timeouts']} request(s) failed or ran past {timeout_s:g}s "
                 "(the server answered BUSY or an error); -v shows the client's log"]
    return lines


def check(client: Client, keys: Sequence[bytes], timeout_s: float) -> None:
    """Raise ToolError when absent ``keys`` are a failure rather than a miss (see :func:`failures`)."""
    lines = failures(client, keys, timeout_s)
    if lines:
        raise ToolError(lines, FAILED)


def _parser(command: str) -> argparse.ArgumentParser:
    doc = {
        "ping": "one PING to every server: round trip, server id, version, protocol, transport",
        "exists": "is each key held, and (--size) how large is it",
        "get": "write a key's value to stdout or -o FILE",
        "put": "store stdin or -i FILE under a key (never overwrites a held key)",
        "del": "delete keys; prints how many stored objects were removed",
    }[command]
    p = argparse.ArgumentParser(prog=f"kvfabric {command}", description=doc,
                                epilog="ADDR: HOST:PORT[,HOST:PORT...], default $KVFABRIC_SERVERS. KEY: hex. "
                                       "Exit status: 0 done, 1 a server failed, 2 bad arguments, 3 not found.")
    if command == "ping":
        p.add_argument("servers", nargs="*", metavar="ADDR", help="HOST:PORT (default: $KVFABRIC_SERVERS)")
    else:
        p.add_argument("args", nargs="+", metavar="[ADDR] KEY", help="the servers, then the key(s) in hex")
    if command == "exists":
        p.add_argument("--size", action="store_true", help="also print each present object's size (fetches it)")
    if command == "get":
        p.add_argument("-o", "--output", metavar="FILE", default=None, help="write the value to FILE (default stdout)")
    if command == "put":
        p.add_argument("-i", "--input", metavar="FILE", default=None, help="read the value from FILE (default stdin)")
    add_options(p)
    return p


def main(command: str, argv: Sequence[str], *, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None,
         out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``kvfabric COMMAND ...`` (one of :data:`COMMANDS`); returns the exit status. ``stdin``/``stdout``:
    the binary streams of put and get; ``out``: text output (default the process's)."""
    prog = f"kvfabric {command}"
    args = _parser(command).parse_args(list(argv))
    quiet_logs(args.verbose)
    text = out or sys.stdout
    return run(prog, lambda: _dispatch(command, args, stdin, stdout, text, environ))


def _dispatch(command: str, args: argparse.Namespace, stdin: BinaryIO | None, stdout: BinaryIO | None, out: TextIO,
              environ: Mapping[str, str] | None) -> int:
    if command == "ping":
        return _ping(client_config(args, addresses(args.servers), environ=environ), out)
    servers, texts = split_args(args.args)
    keys = [parse_key(t) for t in texts]
    if not keys:
        raise ToolError("no key given", USAGE)
    if command in ("get", "put") and len(keys) != 1:
        raise ToolError(f"{command} takes one key, got {len(keys)}", USAGE)
    cfg = client_config(args, servers, environ=environ)
    if command == "put":
        value = _read_value(args.input, stdin)  # before connecting: a bad file costs no connection
        with open_client(cfg) as client:
            return _put(client, cfg, keys[0], value, out)
    with open_client(cfg) as client:
        if command == "exists":
            return _exists(client, cfg, keys, args.size, out)
        if command == "get":
            return _get(client, cfg, keys[0], args.output, stdout)
        return _del(client, cfg, keys, out)


def _ping(cfg: ClientConfig, out: TextIO) -> int:
    with open_client(cfg) as client:
        answers = client.ping(timeout_s=cfg.timeout_s)
    rows = [(address, a["server_id"], a["server"], str(a["version"]), a["transport"], f"{a['rtt_s'] * 1000:.3f}")
            for address, a in answers.items() if "error" not in a]
    if rows:
        print(format_table(PING_COLUMNS, rows), file=out, flush=True)
    bad = [f"{address}: {describe(a['error'], cfg.timeout_s)}" for address, a in answers.items() if "error" in a]
    if bad:
        raise ToolError(bad, FAILED)
    return OK


def _exists(client: Client, cfg: ClientConfig, keys: list[bytes], size: bool, out: TextIO) -> int:
    present = client.exists(keys, timeout_s=cfg.timeout_s)
    sizes: list[Any] = [None] * len(keys)
    if size:
        for i, k in enumerate(keys):
            if present[i]:
                value = client.get([k], timeout_s=cfg.timeout_s)[0]
                present[i], sizes[i] = value is not None, None if value is None else len(value)
    absent = [k for k, p in zip(keys, present) if not p]
    if absent:
        check(client, absent, cfg.timeout_s)
    for k, p, n in zip(keys, present, sizes):
        print(f"{k.hex()} {'present' if p else 'absent'}" + (f" {n if p else '-'}" if size else ""), file=out)
    return NOT_FOUND if absent else OK


def _get(client: Client, cfg: ClientConfig, key: bytes, output: str | None, stdout: BinaryIO | None) -> int:
    value = client.get([key], timeout_s=cfg.timeout_s)[0]
    if value is None:
        check(client, [key], cfg.timeout_s)
        raise ToolError(f"{key.hex()}: not found", NOT_FOUND)
    if output is not None and output != "-":
        try:
            with open(output, "wb") as f:
                f.write(value)
        except OSError as e:
            raise ToolError(f"cannot write {output}: {e.strerror or e}", FAILED) from None
        return OK
    sink = stdout if stdout is not None else sys.stdout.buffer
    try:
        sink.write(value)
        sink.flush()
    except BrokenPipeError:  # `kvfabric get ... | head -c 10`: the reader has what it wanted
        if stdout is None:  # the process's stdout: point it at /dev/null, or exit's flush fails again (status 120)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return OK


def _read_value(path: str | None, stdin: BinaryIO | None) -> bytes:
    """The value to put, at most ``protocol.MAX_OBJECT_BYTES`` (one byte more is read to tell it is over)."""
    limit = protocol.MAX_OBJECT_BYTES
    try:
        if path is not None and path != "-":
            with open(path, "rb") as f:
                value = f.read(limit + 1)
        else:
            value = (stdin if stdin is not None else sys.stdin.buffer).read(limit + 1)
    except OSError as e:
        raise ToolError(f"cannot read {path or 'stdin'}: {e.strerror or e}", FAILED) from None
    if len(value) > limit:
        raise ToolError(f"the value is over the {limit}-byte object limit (MAX_OBJECT_BYTES)", USAGE)
    return value


def _put(client: Client, cfg: ClientConfig, key: bytes, value: bytes, out: TextIO) -> int:
    result = client.put([key], [value], timeout_s=cfg.timeout_s)
    if result.dropped:
        check(client, [key], cfg.timeout_s)
        raise ToolError(f"{key.hex()}: not stored: the server refused it (larger than it accepts, or no "
                        "space: everything evictable is pinned)", FAILED)
    if result.existed:
        print(f"{key.hex()}: already held, not replaced (a put never overwrites a key: del it first)", file=out)
    else:
        print(f"{key.hex()}: stored {len(value)} bytes", file=out)
    return OK


def _del(client: Client, cfg: ClientConfig, keys: list[bytes], out: TextIO) -> int:
    deleted = client.delete(keys, timeout_s=cfg.timeout_s)
    if deleted < len(keys) * cfg.replicas:
        check(client, keys, cfg.timeout_s)
    print(f"deleted {deleted}", file=out)
    return OK

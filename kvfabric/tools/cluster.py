"""``kvfabric cluster ls --etcd URL --cluster NAME``: the members of a cluster, their state and stats.

Reads every member registered under the cluster in etcd (see
``kvfabric/membership/registry.py``), asks each for STATS over tcp (through
the public :class:`kvfabric.Client` with the members' addresses as a static
list, so auth works as for an engine) and prints one row per member:

    server_id  address  state  lease_s  capacity  objects  used  hit%  conns  version  host

``state`` is ``up`` (STATS answered), ``unreachable: why`` (registered, not
answering: dead but its lease not yet expired, or a network problem), or
``id mismatch: ...`` (the process at that address reports another server
id). ``lease_s`` is the time left on the member's etcd lease. ``--json``
prints members and STATS as one JSON document instead. Exit status: 0 when
etcd answered (even with no members), 1 when it did not, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..client import Client
from ..config import ClientConfig
from ..errors import ConfigError
from ..membership import Member
from ..membership.etcd import EtcdClient, EtcdError
from ..membership.registry import check_cluster_name, decode_member, member_prefix
from .stats import format_table, hit_rate, human_bytes

COLUMNS = ("server_id", "address", "state", "lease_s", "capacity", "objects", "used", "hit%", "conns", "version", "host")


def read_members(etcd: EtcdClient, cluster: str) -> list[tuple[Member, int]]:
    """Every member of ``cluster`` with the seconds left on its lease (-1: unknown), by server id."""
    kvs, _ = etcd.range_prefix(member_prefix(cluster))
    out = []
    for kv in kvs:
        m = decode_member(kv.value)
        if m is None:
            continue
        ttl = -1
        if kv.lease:
            try:
                ttl = etcd.lease_ttl(kv.lease)
            except EtcdError:
                pass
        out.append((m, ttl))
    return sorted(out, key=lambda x: x[0].server_id)


def member_stats(members: Sequence[Member], auth_token: str | None, timeout_s: float) -> dict[str, dict[str, Any]]:
    """STATS of each member's address (``{"error": ...}`` where it did not answer)."""
    addresses = list(dict.fromkeys(m.address for m in members))
    if not addresses:
        return {}
    cfg = ClientConfig(transport="tcp", timeout_s=timeout_s, connect_timeout_s=timeout_s, auth_token=auth_token)
    with Client(addresses, config=cfg) as client:
        return client.stats()["servers"]


def rows(members: Sequence[tuple[Member, int]], stats: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    out = []
    for m, ttl in members:
        st = stats.get(m.address, {"error": "not asked"})
        if "error" in st:
            state = f"unreachable: {st['error']}"
        elif st.get("server_id") not in (None, m.server_id):
            state = f"id mismatch: answers as {st.get('server_id')!r}"
        else:
            state = "up"
        ok = "error" not in st
        out.append((
            m.server_id, m.address, state.split(":")[0] if len(state) > 24 else state,
            str(ttl) if ttl >= 0 else "-", human_bytes(m.capacity),
            str(st.get("objects", "-")) if ok else "-", human_bytes(st.get("bytes_used", 0)) if ok else "-",
            hit_rate(st) if ok else "-", str(st.get("connections", "-")) if ok else "-",
            str(m.info.get("version", "-")), str(m.info.get("hostname", "-")),
        ))
    return out


def ls_main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """``kvfabric cluster ls``; returns the exit status."""
    p = argparse.ArgumentParser(prog="kvfabric cluster ls", description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd", required=True, metavar="URL", help="etcd endpoint(s), http://HOST:PORT[,...]")
    p.add_argument("--cluster", default="default", help="cluster name (default 'default')")
    p.add_argument("--auth-token", default=None, help="token for servers started with --auth-token")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for etcd and each server (default 5)")
    p.add_argument("--json", action="store_true", help="print members and their STATS as JSON")
    args = p.parse_args(list(argv))
    try:
        check_cluster_name(args.cluster)
        etcd = EtcdClient(args.etcd, timeout_s=args.timeout)
    except (ValueError, EtcdError) as e:
        print(f"kvfabric cluster ls: {e}", file=sys.stderr)
        return 2
    try:
        members = read_members(etcd, args.cluster)
    except EtcdError as e:
        print(f"kvfabric cluster ls: {e}", file=sys.stderr)
        return 1
    try:
        stats = member_stats([m for m, _ in members], args.auth_token, args.timeout)
    except ConfigError as e:
        print(f"kvfabric cluster ls: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"cluster": args.cluster, "members": [
            {"server_id": m.server_id, "address": m.address, "addresses": dict(m.addresses), "capacity": m.capacity,
             "lease_ttl_s": ttl, "info": dict(m.info), "stats": stats.get(m.address)} for m, ttl in members]}
        print(json.dumps(doc, indent=2, sort_keys=True), file=out)
        return 0
    print(f"cluster {args.cluster}: {len(members)} member(s) in {EtcdClient(args.etcd).url}", file=out)
    if members:
        print(format_table(COLUMNS, rows(members, stats)), file=out)
        for m, _ in members:
            st = stats.get(m.address, {})
            if "error" in st:
                print(f"  {m.server_id}: {st['error']}", file=out)
    return 0


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """``kvfabric cluster <subcommand>``: only ``ls`` so far."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvfabric cluster ls --etcd URL [--cluster NAME] [--json]", file=out)
        return 0 if argv else 2
    if argv[0] == "ls":
        return ls_main(argv[1:], out)
    print(f"kvfabric cluster: unknown subcommand {argv[0]!r} (known: ls)", file=sys.stderr)
    return 2

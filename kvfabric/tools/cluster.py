"""``kvfabric cluster ls --etcd URL --cluster NAME``: the members of a cluster, their state and stats.

Reads every member registered under the cluster in etcd (see
``kvfabric/membership/registry.py``), asks each for STATS over tcp (through
the public :class:`kvfabric.Client` with the members' addresses as a static
list, so auth works as for an engine) and prints one row per member:

    server_id  address  state  lease_s  capacity  objects  used  hit%  conns  version  host

``state`` is ``up`` (STATS answered), ``unreachable: why`` (registered, not
answering: dead but its lease not yet expired, or a network problem),
``id mismatch: ...`` (the process at that address reports another server
id), or ``refused: why``: an entry a client would not route to (malformed,
under another id's key, or, with a token, unsigned or not signed with it;
``kvfabric/membership/registry.py`` read_member). A refused entry is never
contacted, so a forged one never receives the token. ``lease_s`` is the time left on the member's etcd lease. ``--json``
prints members and STATS as one JSON document instead. ``--etcd`` and
``--cluster`` default to ``KVFABRIC_ETCD`` and ``KVFABRIC_CLUSTER``, ``--etcd-ca``,
``--etcd-cert`` and ``--etcd-key`` to ``KVFABRIC_ETCD_CA`` etc.; the token and
timeout options are every tool's (``kvfabric/tools/connect.py``). The etcd
URL is shown with its password masked.
Errors are one line (``kvfabric cluster ls: ...``). Exit status: 0 when etcd
answered (even with no members), 1 when it did not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from ..client import Client
from ..config import ClientConfig
from ..errors import RemoteError
from ..membership import Member
from ..membership.etcd import EtcdClient, EtcdError
from ..membership.registry import check_cluster_name, member_prefix, read_member
from .connect import FAILED, USAGE, ToolError, add_options, client_config, describe, quiet_logs, run
from .stats import format_table, hit_rate, human_bytes

COLUMNS = ("server_id", "address", "state", "lease_s", "capacity", "objects", "used", "hit%", "conns", "version", "host")


def read_members(etcd: EtcdClient, cluster: str, token: str | None = None,
                 refused: list[tuple[str, str]] | None = None) -> list[tuple[Member, int]]:
    """Every member of ``cluster`` a client with ``token`` would route to, with the seconds left on its lease
    (-1: unknown), by server id. The others are appended to ``refused`` as (key's id, why)."""
    kvs, _ = etcd.range_prefix(member_prefix(cluster))
    out = []
    for kv in kvs:
        m, why = read_member(kv.key, kv.value, token, kv.lease)
        if m is None:
            if refused is not None:
                refused.append((kv.key.rsplit(b"/", 1)[-1].decode("utf-8", "replace"), why))
            continue
        ttl = -1
        if kv.lease:
            try:
                ttl = etcd.lease_ttl(kv.lease)
            except EtcdError:
                pass
        out.append((m, ttl))
    return sorted(out, key=lambda x: x[0].server_id)


def member_stats(members: Sequence[Member], cfg: ClientConfig) -> dict[str, dict[str, Any]]:
    """STATS of each member's address over tcp (``{"error": what happened}`` where it did not answer or
    refused the token: every member is asked, whichever of them refuse)."""
    addresses = list(dict.fromkeys(m.address for m in members))
    if not addresses:
        return {}
    cfg = cfg.with_(servers=tuple(addresses), etcd="", transport="tcp", replicas=1)
    try:
        client = Client(config=cfg, allow_rejects=True)
    except RemoteError as e:  # every member refused this client: each gets that answer
        return {a: {"error": describe(e, cfg.timeout_s)} for a in addresses}
    with client:
        servers = client.stats(timeout_s=cfg.timeout_s)["servers"]
    return {a: {"error": describe(st["error"], cfg.timeout_s)} if "error" in st else st for a, st in servers.items()}


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


def ls_main(argv: Sequence[str], out: TextIO = sys.stdout, environ: Mapping[str, str] | None = None) -> int:
    """``kvfabric cluster ls``; returns the exit status."""
    p = argparse.ArgumentParser(prog="kvfabric cluster ls", description=__doc__.split("\n\n")[0],
                                epilog="Exit status: 0 etcd answered, 1 it did not, 2 bad arguments.")
    p.add_argument("--etcd", default=None, metavar="URL",
                   help="etcd endpoint(s), https://HOST:PORT or http://HOST:PORT[,...] (default: $KVFABRIC_ETCD)")
    p.add_argument("--cluster", default=None, help="cluster name (default: $KVFABRIC_CLUSTER, else 'default')")
    p.add_argument("--etcd-ca", default=None, metavar="FILE",
                   help="CA file for https:// etcd endpoints (default: $KVFABRIC_ETCD_CA)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE",
                   help="client certificate for etcd (default: $KVFABRIC_ETCD_CERT)")
    p.add_argument("--etcd-key", default=None, metavar="FILE",
                   help="its key, when a separate file (default: $KVFABRIC_ETCD_KEY)")
    p.add_argument("--json", action="store_true", help="print members and their STATS as JSON")
    add_options(p, transport=False)
    args = p.parse_args(list(argv))
    quiet_logs(args.verbose)
    return run("kvfabric cluster ls", lambda: _ls(args, out, environ))


def _ls(args: argparse.Namespace, out: TextIO, environ: Mapping[str, str] | None) -> int:
    cfg = client_config(args, transport="tcp", environ=environ)
    etcd_url = args.etcd or cfg.etcd
    cluster = args.cluster or cfg.cluster
    if not etcd_url:
        raise ToolError("no etcd: give --etcd URL or set KVFABRIC_ETCD", USAGE)
    try:
        check_cluster_name(cluster)
        etcd = EtcdClient(etcd_url, timeout_s=cfg.timeout_s, ca_file=args.etcd_ca or cfg.etcd_ca,
                          cert_file=args.etcd_cert or cfg.etcd_cert, key_file=args.etcd_key or cfg.etcd_key)
    except (ValueError, EtcdError) as e:
        raise ToolError(str(e), USAGE) from None
    refused: list[tuple[str, str]] = []
    try:
        members = read_members(etcd, cluster, cfg.auth_token, refused)
    except EtcdError as e:
        raise ToolError(str(e), FAILED) from None
    stats = member_stats([m for m, _ in members], cfg)  # refused entries are never contacted
    if args.json:
        doc = {"cluster": cluster, "etcd": etcd.url, "members": [
            {"server_id": m.server_id, "address": m.address, "addresses": dict(m.addresses), "capacity": m.capacity,
             "lease_ttl_s": ttl, "info": dict(m.info), "stats": stats.get(m.address)} for m, ttl in members],
            "refused": [{"key_id": k, "why": why} for k, why in refused]}
        print(json.dumps(doc, indent=2, sort_keys=True), file=out)
        return 0
    print(f"cluster {cluster}: {len(members)} member(s) in {etcd.url}"
          + (f"; {len(refused)} entr{'y' if len(refused) == 1 else 'ies'} refused" if refused else ""), file=out)
    if members:
        print(format_table(COLUMNS, rows(members, stats)), file=out)
        for m, _ in members:
            st = stats.get(m.address, {})
            if "error" in st:
                print(f"  {m.server_id}: {st['error']}", file=out)
    for key_id, why in refused:
        print(f"  refused: {key_id[:64]}: {why}", file=out)
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

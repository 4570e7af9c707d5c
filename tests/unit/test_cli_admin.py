"""The admin tools' pure parts: hex keys, ``[ADDR] KEY...``, config precedence, error wording, ``bench --help``."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys

import pytest

from kvfabric import cli
from kvfabric.errors import ErrorCode, RemoteError
from kvfabric.tools.admin import parse_key, split_args
from kvfabric.tools.connect import ToolError, add_options, client_config, describe


def test_parse_key_accepts_hex_of_1_to_64_bytes_and_names_what_is_wrong():
    assert parse_key("00ff") == b"\x00\xff"
    assert parse_key("0xABcd") == b"\xab\xcd"
    assert parse_key("11" * 64) == b"\x11" * 64
    for bad, why in [("", "not a hex string"), ("0x", "not a hex string"), ("g0", "not a hex string"),
                     ("ab cd", "not a hex string"), ("abc", "odd number of hex digits (3"), ("11" * 65, "65 bytes")]:
        with pytest.raises(ToolError) as e:
            parse_key(bad)
        assert e.value.status == 2 and why in e.value.lines[0] and "32 hex digits" in e.value.lines[0], e.value.lines


def test_split_args_takes_the_first_argument_as_addresses_only_when_it_has_a_colon():
    assert split_args(["h:1,h:2", "aa", "bb"]) == (["h:1", "h:2"], ["aa", "bb"])
    assert split_args(["aa", "bb"]) == ([], ["aa", "bb"])
    assert split_args([]) == ([], [])


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_options(p)
    return p.parse_args(list(argv))


def test_client_config_flags_over_environment_over_tool_defaults(tmp_path):
    cfg = client_config(_args(), environ={})
    assert (cfg.timeout_s, cfg.connect_timeout_s, cfg.auth_token, cfg.servers) == (5.0, 5.0, None, ())
    env = {"KVFABRIC_SERVERS": "h:1,h:2", "KVFABRIC_AUTH_TOKEN": "envtok", "KVFABRIC_TIMEOUT_S": "7",
           "KVFABRIC_TRANSPORT": "tcp"}
    cfg = client_config(_args(), environ=env)
    assert (cfg.servers, cfg.auth_token, cfg.timeout_s, cfg.connect_timeout_s, cfg.transport) == \
        (("h:1", "h:2"), "envtok", 7.0, 5.0, "tcp")
    token = tmp_path / "t"
    token.write_text("filetok\n")
    cfg = client_config(_args("--token-file", str(token), "--timeout", "9", "--transport", "native"), ["x:3"],
                        environ={**env, "KVFABRIC_ETCD": "http://e:2379"})
    assert (cfg.servers, cfg.etcd, cfg.auth_token, cfg.timeout_s, cfg.connect_timeout_s, cfg.transport) == \
        (("x:3",), "", "filetok", 9.0, 9.0, "native")
    assert client_config(_args("--transport", "native"), transport="tcp", environ={}).transport == "tcp"


def test_client_config_bad_values_are_usage_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for argv, env, needle in [(("--token", "a", "--token-file", "f"), {}, "not both"),
                              (("--token-file", str(empty)), {}, "is empty"),
                              (("--token-file", str(tmp_path / "missing")), {}, "cannot read --token-file"),
                              (("--token", " "), {}, "must not be empty"),
                              ((), {"KVFABRIC_REPLICAS": "two"}, "KVFABRIC_REPLICAS")]:
        with pytest.raises(ToolError) as e:
            client_config(_args(*argv), environ=env)
        assert e.value.status == 2 and needle in e.value.lines[0], (argv, e.value.lines)


def test_describe_puts_each_failure_in_words():
    assert describe("RemoteError: server error AUTH_FAILED: authentication failed", 5) == \
        "authentication failed (wrong or missing --token)"
    assert describe(RemoteError(ErrorCode.AUTH_FAILED, "server h:1 rejected this client"), 5) == \
        "authentication failed (wrong or missing --token)"
    assert describe("TransportError: cannot connect to h:1: [Errno 111] Connection refused", 5).startswith(
        "connection refused")
    assert describe("DeadlineExceeded: HELLO to h:1 ran past its deadline", 2.5) == "no answer within 2.5s (--timeout)"
    assert "version mismatch" in describe("RemoteError: server error BAD_VERSION: speaks 3", 5)
    assert describe("TransportError: cannot connect to h:1: [Errno -2] Name or service not known", 5) == \
        "cannot connect to h:1: [Errno -2] Name or service not known"


def test_bench_help_has_one_line_per_benchmark_from_its_docstring_without_importing_it():
    found = cli.bench_modules()
    assert found, "no benchmark modules"
    before = set(sys.modules)
    text = cli.bench_help(found)
    assert not {f"kvfabric.bench.{n}" for n in found} & (set(sys.modules) - before), "bench --help imported a benchmark"
    lines = text.splitlines()[3:]
    assert [line.split()[0] for line in lines] == found, text
    for name, line in zip(found, lines):
        spec = importlib.util.find_spec(f"kvfabric.bench.{name}")
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        assert doc, f"kvfabric/bench/{name}.py has no module docstring"
        summary = line.split(None, 1)[1]
        assert summary == cli.bench_summary(name) and len(summary) <= 100, line


def test_summary_line_drops_the_command_label_and_cuts_at_a_word():
    assert cli.summary_line("``kvfabric bench keys``: block-key throughput.\n\nMore.", "kvfabric bench keys") == \
        "Block-key throughput."
    assert cli.summary_line("``kvfabric bench replay TRACE``: replay a trace.", "kvfabric bench replay") == \
        "Replay a trace."
    assert cli.summary_line("The offline bound: Belady's MIN.", "kvfabric bench belady") == \
        "The offline bound: Belady's MIN."
    long = cli.summary_line("word " * 40, "x")
    assert len(long) <= 100 and long.endswith("word...")

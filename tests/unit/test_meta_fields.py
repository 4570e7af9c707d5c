"""Metadata field names come from one list (kvfabric.protocol.META_FIELDS): the Python messages
spell each as there, and csrc/ names a field only through its KVF_F_<NAME> macro
(csrc/kvf_protocol.h), never as a bare string that could drift from the Python side."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvfabric.protocol import META_FIELDS, Limits

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "kvfabric" / "protocol"
CSRC = ROOT / "csrc"
# kvf_stats.c writes the STATS reply: its keys are kvfabric.protocol.stats's schema, not fields
C_NOT_FIELDS = {"kvf_stats.c"}
# the C calls that take a field name: find it in a map, write it as a key, parse it
C_FIELD_CALL = re.compile(r"\b(kvf_mr_find|kvf_mw_cstr|kvf_parse_uints?|kvf_parse_bool|find_int_array)\(([^;]*?)\)", re.S)
C_MACRO = re.compile(r'^#define KVF_F_([A-Z_]+) "([a-z_]+)"$', re.M)
# the helpers in wire.py / messages.py whose second argument is a field name
PY_FIELD_HELPERS = {"_field", "_uint_list"}


def python_field_names() -> dict[str, set[str]]:
    """Field names the protocol package's Python spells out: dict keys of to_meta() maps,
    ``m["name"] = ...``, ``meta.get("name")`` and the _field/_uint_list helpers' name argument."""
    found: dict[str, set[str]] = {}
    for path in (PROTOCOL / "messages.py", PROTOCOL / "wire.py"):
        tree = ast.parse(path.read_text(), str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    names.add(node.slice.value)
            elif isinstance(node, ast.Call):
                fn = node.func
                if isinstance(fn, ast.Attribute) and fn.attr == "get" and isinstance(fn.value, ast.Name) \
                        and fn.value.id == "meta" and node.args and isinstance(node.args[0], ast.Constant):
                    names.add(node.args[0].value)
                elif isinstance(fn, ast.Name) and fn.id in PY_FIELD_HELPERS and len(node.args) >= 2 \
                        and isinstance(node.args[1], ast.Constant):
                    names.add(node.args[1].value)
        found[path.name] = names
    return found


def c_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(CSRC.glob("*.c")) if p.name not in C_NOT_FIELDS}


def test_the_python_messages_use_exactly_the_listed_names():
    found = python_field_names()
    used = set().union(*found.values()) | set(Limits.__dataclass_fields__)
    assert used - META_FIELDS == set(), f"names the protocol package uses but META_FIELDS lacks: {found}"
    assert META_FIELDS - used == set(), "names META_FIELDS lists that no message sends or reads"


def test_the_c_macros_are_the_listed_names_and_each_is_used():
    header = (CSRC / "kvf_protocol.h").read_text()
    macros = dict(C_MACRO.findall(header))
    assert len(macros) >= 15, f"csrc/kvf_protocol.h: expected the KVF_F_* block, found {macros}"
    wrong = {m: v for m, v in macros.items() if m.lower() != v}
    assert wrong == {}, f"KVF_F_<NAME> must spell <name>: {wrong}"
    assert set(macros.values()) - META_FIELDS == set(), "C field names not in kvfabric.protocol.META_FIELDS"
    text = "\n".join(c_sources().values())
    unused = sorted(m for m in macros if not re.search(rf"\bKVF_F_{m}\b", text))
    assert unused == [], f"KVF_F_ macros no C file uses: {unused}"


def test_no_c_file_names_a_field_with_a_bare_string():
    bare = []
    for name, text in c_sources().items():
        for call in C_FIELD_CALL.finditer(text):
            for lit in re.findall(r'"([a-z_]+)"', call.group(2)):
                if lit in META_FIELDS:
                    line = text.count("\n", 0, call.start()) + 1
                    bare.append(f"{name}:{line}: {call.group(0)[:100]}")
    assert bare == [], "use the KVF_F_* macro (csrc/kvf_protocol.h) instead:\n" + "\n".join(bare)


def test_the_scanners_see_what_they_look_for():
    """Each scanner above finds its pattern in code written the way the sources write it, so an
    empty result means the sources are clean, not that the patterns stopped matching."""
    calls = [c.group(0) for c in C_FIELD_CALL.finditer('x = kvf_mr_find(m.p, m.n, "keys", &n);\n'
                                                       'kvf_mw_cstr(&w, KVF_F_SIZES);')]
    assert calls == ['kvf_mr_find(m.p, m.n, "keys", &n)', "kvf_mw_cstr(&w, KVF_F_SIZES)"]
    assert C_MACRO.findall('#define KVF_F_LEASE_MS "lease_ms"\n') == [("LEASE_MS", "lease_ms")]
    found = python_field_names()
    assert {"keys", "sizes", "checksums", "code", "message"} <= found["messages.py"], found
    assert {"auth_required", "shm_socket", "parents"} <= found["messages.py"], found  # meta.get(...) and m[...] = ...
    # the C sources do call these functions with the macros (the bare-string check looks at them)
    assert sum(len(C_FIELD_CALL.findall(t)) for t in c_sources().values()) >= 30

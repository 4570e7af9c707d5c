"""The block-key spec: golden vectors, the chain definition, and input handling."""

import hashlib
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import xxhash

from kvfabric.errors import ConfigError
from kvfabric.keys import KeyAlgorithm, KeyHasher, Namespace, chunk_keys, pack_tokens, prefix_keys

GOLDEN_NS = Namespace(
    model="kvfabric/golden", revision="r1", dtype="float16", kv_layout="paged-v1",
    block_tokens=4, tp_rank=1, tp_size=2, extras={"salt": "x", "mm": [1, 2]},
)
GOLDEN_TOKENS = list(range(10))  # two whole blocks of 4, and 2 tokens that get no key

GOLDEN = {
    ("xxh3_128", b""): ["369abac9632ffb54e93d5d5d086da777", "17f98830cc5a7676f662d7e1945e2f5d"],
    ("xxh3_128", b"deployment-secret"): ["f8a11a99f7cc479f1174aa6d35834e6c", "88c1f40819f2df16aa853c4a6a70daee"],
    ("blake3", b""): [
        "6eaf3d80f9d33bde4b95a2bf61ca2ffc2c849c44a4de3e80b09fbb7ed97b3742",
        "8b0fdb234c5ca897278adc7c630f07b2919e8124ec90207f56660ee88f5dada9",
    ],
    ("blake3", b"deployment-secret"): [
        "24272d4b59bfe3251250f525fec0b73c8f8c41ae2dabdcf184f2a9f0dae92b30",
        "23fc674dcf4ecabe517d35ab375c9fafce122e8086f3b2220c47d43a262cf892",
    ],
    ("sha256", b""): [
        "a18ac0efe17af2814b249f3b01920a4cbc59c42d1071204e925b780fb364ac1b",
        "0b7d161fb26d1fb375b05a4e59cc8142cf94e58d3c1ce2c1ae21b13d2fcff8c1",
    ],
    ("sha256", b"deployment-secret"): [
        "625109cf2e776d5c0b3a62a39c4f13cd9a1c25b88bedf786d66d153309d4c331",
        "a6c9d31cbf497397babfad93544a6657549e3552ce33aa44e2fbed689659e2c0",
    ],
}


@pytest.mark.parametrize("algorithm,secret", sorted(GOLDEN))
def test_golden_vectors(algorithm, secret):
    keys = KeyHasher(algorithm, secret).prefix_keys(GOLDEN_NS, GOLDEN_TOKENS)
    assert [k.hex() for k in keys] == GOLDEN[(algorithm, secret)]
    assert all(len(k) == KeyAlgorithm(algorithm).key_bytes for k in keys)


def test_canonical_namespace_bytes_are_pinned():
    assert Namespace(model="m").canonical().hex() == (
        "8dac626c6f636b5f746f6b656e73cd0100a56474797065a0a665787472617380a96b765f6c61796f7574a0a46c6f"
        "7261a0a56d6f64656ca16da770705f72616e6b00a770705f73697a6501a87265766973696f6ea0a47370656301a6"
        "74656e616e74a0a774705f72616e6b00a774705f73697a6501"
    )


def test_chain_matches_the_written_spec():
    """Recompute the xxh3 chain from the docstring's definition, without KeyHasher."""
    ns = Namespace(model="spec-check", block_tokens=3)
    tokens = [7, 300, 70000, 1, 2, 3, 4]
    seed = int.from_bytes(hashlib.blake2b(b"s", digest_size=32, person=b"kvfabric-key-v1").digest()[:8], "little")
    prev = xxhash.xxh3_128_digest(b"kvfabric-namespace" + ns.canonical(), seed)
    expected = []
    for i in range(2):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[3 * i : 3 * i + 3])
        prev = xxhash.xxh3_128_digest(prev + block, seed)
        expected.append(prev)
    assert KeyHasher("xxh3_128", b"s").prefix_keys(ns, tokens) == expected


def test_keys_name_the_whole_prefix():
    ns = Namespace(model="m", block_tokens=2)
    a = prefix_keys(ns, [1, 2, 3, 4])
    b = prefix_keys(ns, [9, 2, 3, 4])  # same second block, different first block
    assert a[1] != b[1]
    assert prefix_keys(ns, [1, 2, 3, 4, 5, 6])[:2] == a  # extending a prompt keeps its keys


def test_parent_continues_a_chain():
    ns = Namespace(model="m", block_tokens=2)
    whole = prefix_keys(ns, [1, 2, 3, 4, 5, 6])
    assert prefix_keys(ns, [3, 4, 5, 6], parent=whole[0]) == whole[1:]
    with pytest.raises(ValueError):
        prefix_keys(ns, [3, 4], parent=b"short")


@pytest.mark.parametrize(
    "field,value",
    [("model", "other"), ("revision", "r2"), ("dtype", "bfloat16"), ("kv_layout", "x"), ("block_tokens", 8),
     ("tp_rank", 1), ("pp_size", 2), ("lora", "adapter"), ("tenant", "t2"), ("extras", {"salt": "y"})],
)
def test_every_namespace_field_changes_the_keys(field, value):
    base = dict(model="m", block_tokens=4, tp_size=2, extras={"salt": "x"})
    changed = dict(base, **{field: value})
    tokens = list(range(8))
    assert prefix_keys(Namespace(**base), tokens)[0] != prefix_keys(Namespace(**changed), tokens)[0]


def test_secret_and_algorithm_change_the_keys():
    ns = Namespace(model="m", block_tokens=4)
    t = list(range(4))
    keys = {prefix_keys(ns, t, secret=s, algorithm=a)[0] for s in (b"", b"a", b"b") for a in KeyAlgorithm}
    assert len(keys) == 9


def test_token_inputs_agree_across_types():
    ns = Namespace(model="m", block_tokens=4)
    ref = prefix_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8])
    assert prefix_keys(ns, np.arange(1, 9, dtype=np.int64)) == ref
    assert prefix_keys(ns, np.arange(1, 9, dtype=np.uint16)) == ref
    assert prefix_keys(ns, np.arange(1, 9, dtype=np.int32).astype(">i4")) == ref
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_bad_tokens_are_rejected():
    with pytest.raises(ValueError):
        pack_tokens([-1])
    with pytest.raises(ValueError):
        pack_tokens(np.array([2**32], dtype=np.int64))
    with pytest.raises(TypeError):
        pack_tokens([1.5])
    with pytest.raises(ValueError):
        pack_tokens(np.zeros((2, 2), dtype=np.int32))


def test_partial_blocks_get_no_key():
    ns = Namespace(model="m", block_tokens=4)
    assert prefix_keys(ns, [1, 2, 3]) == []
    assert len(prefix_keys(ns, list(range(11)))) == 2


def test_bad_config_is_a_clear_error():
    with pytest.raises(ConfigError):
        KeyHasher("md5")
    with pytest.raises(ConfigError):
        Namespace(model="")
    with pytest.raises(ConfigError):
        Namespace(model="m", block_tokens=0)
    with pytest.raises(ConfigError):
        Namespace(model="m", tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError):
        Namespace(model="m", extras={"x": object()}).canonical()


def test_keys_do_not_depend_on_pythonhashseed():
    code = (
        "from kvfabric.keys import Namespace, prefix_keys;"
        "print(prefix_keys(Namespace(model='m', block_tokens=2, extras={'b': 1, 'a': 2}), [1,2,3,4])[1].hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True,
                       check=True).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1


def test_canonical_form_is_sorted_msgpack():
    meta = msgpack.unpackb(Namespace(model="m", extras={"z": 1, "a": {"y": 2, "b": 3}}).canonical())
    assert list(meta) == sorted(meta)
    assert list(meta["extras"]) == ["a", "z"] and list(meta["extras"]["a"]) == ["b", "y"]


# Chunk keys (position-independent): same namespace and tokens as GOLDEN; the
# third key is the trailing partial block [8, 9].
GOLDEN_CHUNK = {
    ("xxh3_128", b""): ["2196108bbc50978d1940d2cdd360e480", "86840d224c5bc11b1011ebc5b59c6035",
                        "18668eea9987801b6dcb10d135a8c287"],
    ("xxh3_128", b"deployment-secret"): ["688f38a571d4cfe281622cb9c6827749", "121b27e75d22e6bc769de53bdd967e1e",
                                         "23ae2078ae41e6abae966cdfe49e55b1"],
    ("blake3", b""): [
        "50636ca0ade037a8d3769d5dade6b6c0ab04e43ac57f95c5864d648a933270f5",
        "6e1b8a10daed207659e517be54485879359e4d4e54154393a561578826a61d76",
        "ead73d3ded45e733653f91992200216bdc2a1c4ee172fde6f3777a8d7692b155",
    ],
    ("blake3", b"deployment-secret"): [
        "f33ed9448132b339bb9d15a440008ca32e94208a0c13ee7afe66047ae2143ce3",
        "d7039bedcc3d96504d29a1dc00f7e5e031a17ddbd30d26bef94049c474dd655e",
        "075143dd8b9a34fcb9f2bd1b44934c5d611d88128dd7b5fd05fdb9230bb51c52",
    ],
    ("sha256", b""): [
        "a43fa089e22b258ac153ff931fd06699a887ad17f41b3ccb74feb27b80e41f6b",
        "bfc8ae61d992b2faa0bcdabdf3c59b8ea4a63f694590a01caab67277fe319b90",
        "624e87ccfb7ee1873b568892cd3a438cee27b662904dcf36b5c0b762d5844864",
    ],
    ("sha256", b"deployment-secret"): [
        "d2fde88df53f319bd5a027c008edc2b91e00af0c23e08e0b801a25df64926125",
        "a5527b429c42da8ab996623801f54f55d53e29bd085e831a12281587d32d9227",
        "8e0b91b60e74f85c91d7fe939dac3ab8311efcea0fb4603c60e976be3ef1a90a",
    ],
}


@pytest.mark.parametrize("algorithm,secret", sorted(GOLDEN_CHUNK))
def test_chunk_golden_vectors(algorithm, secret):
    keys = KeyHasher(algorithm, secret).chunk_keys(GOLDEN_NS, GOLDEN_TOKENS)
    assert [k.hex() for k in keys] == GOLDEN_CHUNK[(algorithm, secret)]
    assert KeyHasher(algorithm, secret).chunk_keys(GOLDEN_NS, GOLDEN_TOKENS, tail=False) == keys[:2]


def test_chunk_chain_matches_the_written_spec():
    """Recompute the xxh3 chunk chain from the docstring, including the partial tail block."""
    ns = Namespace(model="spec-check", block_tokens=3)
    tokens = [7, 300, 70000, 1, 2, 3, 4]
    seed = int.from_bytes(hashlib.blake2b(b"s", digest_size=32, person=b"kvfabric-key-v1").digest()[:8], "little")
    prev = xxhash.xxh3_128_digest(b"kvfabric-chunk" + ns.canonical(), seed)
    expected = []
    for i in range(3):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[3 * i : 3 * i + 3])
        prev = xxhash.xxh3_128_digest(prev + block, seed)
        expected.append(prev)
    assert KeyHasher("xxh3_128", b"s").chunk_keys(ns, tokens) == expected


def test_chunk_keys_do_not_depend_on_position_and_differ_from_prefix_keys():
    ns = Namespace(model="m", block_tokens=2)
    passage = [5, 6, 7, 8, 9]
    alone = chunk_keys(ns, passage)
    assert len(alone) == 3  # two whole blocks and the tail [9]
    for before in ([], [1, 2], [1, 2, 3], [4] * 7):
        prompt = before + passage
        # The same passage after any prefix keeps its chunk keys ...
        assert chunk_keys(ns, prompt[len(before):]) == alone
    # ... while its prefix keys change with what precedes it.
    assert prefix_keys(ns, [1, 2] + passage)[1] != prefix_keys(ns, [3, 4] + passage)[1]
    # Domain separation: a chunk at position 0 still does not collide with the prefix key.
    assert chunk_keys(ns, passage)[:2] != prefix_keys(ns, passage)
    # Chained within the chunk: a different first block changes the second key.
    assert chunk_keys(ns, [0, 6, 7, 8])[1] != chunk_keys(ns, [5, 6, 7, 8])[1]
    assert chunk_keys(ns, []) == []
    # The tail key names the tail's length: [9] and [9, 0] are different blocks.
    assert chunk_keys(ns, [5, 6, 9])[1] != chunk_keys(ns, [5, 6, 9, 0])[1]


def test_chunk_keys_bind_the_namespace_and_secret():
    base = Namespace(model="m", block_tokens=4)
    t = list(range(6))
    assert chunk_keys(base, t) != chunk_keys(Namespace(model="m", block_tokens=4, tenant="t2"), t)
    assert chunk_keys(base, t) != chunk_keys(base, t, secret=b"x")
    assert chunk_keys(base, np.arange(6, dtype=np.int64)) == chunk_keys(base, t)

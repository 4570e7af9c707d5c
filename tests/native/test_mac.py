"""The C HMAC-SHA256 (csrc/kvf_mac.c) is the standard one: RFC 4231's vectors and Python's hmac."""

import hashlib
import hmac
import os

import pytest

native = pytest.importorskip("kvfabric._native")

# RFC 4231, test cases 1, 2, 3, 6 and 7 (HMAC-SHA-256): (key, data, mac hex)
RFC4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. "
     b"The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key,data,want", RFC4231)
def test_rfc4231_vectors(key, data, want):
    assert native.hmac_sha256(key, data).hex() == want


def test_matches_python_hmac_at_every_block_boundary_and_split():
    rng = __import__("random").Random(4231)
    for n in [*range(0, 130), 1000, 4096, 65537]:
        key = os.urandom(rng.choice([0, 1, 16, 32, 63, 64, 65, 200]))
        data = os.urandom(n)
        want = hmac.new(key, data, hashlib.sha256).digest()
        cut = sorted(rng.randrange(n + 1) for _ in range(rng.randrange(4)))
        parts = [data[a:b] for a, b in zip([0, *cut], [*cut, n])]
        got = native.hmac_sha256(key, *parts)
        assert got == want, (len(key), n, [len(p) for p in parts])


def test_part_count_is_bounded():
    with pytest.raises(TypeError):
        native.hmac_sha256()
    with pytest.raises(TypeError):
        native.hmac_sha256(b"k", *([b"x"] * 17))
    assert native.hmac_sha256(b"k", *([b"x"] * 16)) == hmac.new(b"k", b"x" * 16, hashlib.sha256).digest()

"""HELLO's mutual proof (protocol 3): both sides show they hold the pool token, which never crosses the wire.

The exchange on a connection to a server with a token (``--auth-token``)::

    client -> HELLO  {version: 3, client, transports, nonce: Nc}            Nc: 32 fresh random bytes
    server -> reply  {..., server_id: S, auth_required: true, nonce: Ns,    Ns: 32 fresh random bytes,
                      proof: server_proof(token, Nc, Ns, S)}                    per connection
    client:  checks the proof (constant time); a missing or wrong one: the server is refused
             before any key, PUT or lookup is sent to it (and AUTH is never sent)
    client -> AUTH   {proof: client_proof(token, Ns, Nc)}
    server -> reply  {}  (wrong or missing proof: AUTH_FAILED, counted, logged, closed)

Until AUTH succeeds the server answers anything but HELLO and AUTH with
AUTH_FAILED (and closes); the pre-auth limits apply to both. A server without
a token says ``auth_required: false`` and sends neither nonce nor proof; a
client with a token refuses it (a peer without the token could say the same),
and a client without a token refuses a server that says ``auth_required: true``.

Both proofs are HMAC-SHA256 keyed by the token's UTF-8 bytes, over a label
that names the direction (so one side's proof is never valid as the other's),
then both nonces (each side's own fresh nonce makes a recorded proof useless on
any later connection), then, in the server's, its ``server_id`` (the id the
client routes under is the one the server proved). The C data plane computes
the same with ``kvf_hmac_sha256`` (csrc/kvf_mac.h); fixed vectors in
``tests/unit/test_protocol.py`` pin this module, and ``tests/native/test_auth.py``
checks the C server's proofs against them.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ..errors import ConfigError

#: Bytes of each side's nonce and of each proof (an HMAC-SHA256).
NONCE_BYTES = 32
PROOF_BYTES = 32
SERVER_LABEL = b"kvfabric-hello-server-v3"
CLIENT_LABEL = b"kvfabric-hello-client-v3"


def check_token(token: str | None) -> None:
    """ConfigError unless ``token`` is None or a non-empty str without NUL characters.

    HMAC pads a key shorter than its block with zero bytes, so ``"t"`` and ``"t\\0"`` would be one
    key: a token that may hold a NUL is refused on both sides instead (the C server's token is a
    C string for the same reason)."""
    if token is None:
        return
    if not isinstance(token, str) or not token or "\0" in token:
        raise ConfigError("the pool token (auth_token) must be a non-empty str without NUL characters")


def new_nonce() -> bytes:
    """:data:`NONCE_BYTES` fresh bytes from the OS's CSPRNG."""
    return os.urandom(NONCE_BYTES)


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes, server_id: str) -> bytes:
    """``HMAC(token, SERVER_LABEL || client_nonce || server_nonce || server_id_utf8)``."""
    return hmac.new(token.encode(), SERVER_LABEL + client_nonce + server_nonce + server_id.encode(),
                    hashlib.sha256).digest()


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """``HMAC(token, CLIENT_LABEL || server_nonce || client_nonce)``."""
    return hmac.new(token.encode(), CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def proof_ok(expected: bytes, got: bytes | None) -> bool:
    """Whether ``got`` is ``expected``, compared in constant time; None (no proof sent) is never."""
    return got is not None and hmac.compare_digest(expected, got)


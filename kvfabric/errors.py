"""The kvfabric exception hierarchy and the stable wire error codes.

A miss is a value, a failure is an exception. Everything kvfabric raises on
purpose derives from :class:`KVFabricError`, so connectors can catch that one
class and degrade to a miss without swallowing programming errors
(``TypeError``, ``ValueError`` for bad arguments are raised as they are).

The numeric codes in :class:`ErrorCode` travel in error replies on the wire;
they never change meaning once released.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    BAD_MAGIC = 1
    BAD_VERSION = 2
    UNKNOWN_OPCODE = 3
    MALFORMED = 4
    TOO_MANY_KEYS = 5
    PAYLOAD_TOO_LARGE = 6
    META_TOO_LARGE = 7
    LENGTH_MISMATCH = 8
    AUTH_FAILED = 9
    TOO_MANY_IN_FLIGHT = 10
    BUSY = 11
    INTERNAL = 12
    BAD_KEY = 13


# After these the byte stream cannot be trusted: the server replies, then closes.
FATAL_CODES = frozenset(
    {
        ErrorCode.BAD_MAGIC,
        ErrorCode.BAD_VERSION,
        ErrorCode.LENGTH_MISMATCH,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.META_TOO_LARGE,
        ErrorCode.AUTH_FAILED,
    }
)


class KVFabricError(Exception):
    """Base of every error kvfabric raises on purpose."""


class ConfigError(KVFabricError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class ProtocolError(KVFabricError):
    """Bytes on the wire do not form a valid frame.

    ``code`` is the :class:`ErrorCode` the server sends back for it.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message

    @property
    def fatal(self) -> bool:
        """True when the connection cannot be resynchronised after this error."""
        return self.code in FATAL_CODES


class RemoteError(KVFabricError):
    """The server answered a request with an error reply."""

    def __init__(self, code: int, message: str) -> None:
        try:
            self.code: ErrorCode | int = ErrorCode(code)
            name = self.code.name
        except ValueError:
            self.code = code
            name = f"code {code}"
        super().__init__(f"server error {name}: {message}")
        self.message = message


class RetireError(KVFabricError):
    """``Client.retire`` did not reach every server (issue 27): ``results`` maps each server's
    address to its new generation (int) or the error that stopped it (str). The servers that
    answered have retired the tag; the others may still serve its objects, so the caller must
    retry (RETIRE is safe to repeat) or take those servers out."""

    def __init__(self, message: str, results: dict[str, int | str]) -> None:
        super().__init__(message)
        self.results = results


class AuthError(RemoteError):
    """The pool-token exchange of HELLO failed on this side (protocol 3).

    Raised by a client whose server did not prove it holds the pool token (a
    missing or wrong ``proof``, or ``auth_required: false`` while the client
    has a token), or that requires a token the client does not have. It is an
    ``AUTH_FAILED`` :class:`RemoteError` so that every caller that handles a
    server's refusal handles this one the same way (the client marks the
    server down: its keys are misses, it is never used). ``message`` names the
    server's address; ``str()`` is ``"AUTH_FAILED: <message>"`` (without the
    ``server error`` of a server's own refusal), so a log line names the code.
    """

    def __init__(self, message: str) -> None:
        KVFabricError.__init__(self, f"{ErrorCode.AUTH_FAILED.name}: {message}")
        self.code = ErrorCode.AUTH_FAILED
        self.message = message


class TransportError(KVFabricError):
    """The connection broke, timed out, or could not be made.

    The client turns these into misses for the affected shard; ``__cause__``
    holds the underlying ``OSError`` when there is one.
    """


class ConnectionClosed(TransportError):
    """The peer closed the connection (or it was closed by us)."""


class DeadlineExceeded(TransportError):
    """A call did not complete before its deadline."""


class TransportUnavailable(KVFabricError):
    """A transport that was explicitly asked for cannot be used here.

    Raised instead of silently falling back to a slower transport.
    """


class ChecksumError(KVFabricError):
    """Object bytes do not match their checksum (reported as a miss by the client)."""


class NativeError(KVFabricError, OSError):
    """An errno reported by the C extension."""

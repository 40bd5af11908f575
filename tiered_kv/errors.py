"""The one error hierarchy of tiered-kv.

Exceptions are for callers that asked for something impossible (bad config, a block that is not
what it claims to be). "No room" and "backend down" are *misses with a counted reason* in the
engine's hot path; the store turns the backend exceptions below into those counts.
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Base class of every error raised by tiered-kv."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is missing, unknown or out of range. The message names the key."""


class TokenError(TieredKVError, ValueError):
    """Tokens or extras cannot be turned into a block key (e.g. a token id out of range)."""


class CorruptBlock(TieredKVError):
    """A stored block failed validation. ``reason`` is the counted miss reason."""

    reason = "corrupt"

    def __init__(self, detail: str, *, reason: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if reason is not None:
            self.reason = reason


class NamespaceMismatch(CorruptBlock):
    """A stored block belongs to another namespace (other model, dtype, shape, salt, ...)."""

    reason = "namespace_mismatch"


class DamagedRecord(CorruptBlock):
    """A medium's own bookkeeping record (e.g. an LMDB ``meta`` record) cannot be read: too short,
    or with a field out of range. The medium treats its entry as damaged (counted, skipped or
    dropped; ``check(fix=True)`` rebuilds it); it never reaches the engine."""

    reason = "damaged_record"


class BackendError(TieredKVError):
    """A storage medium failed."""


class BackendUnavailable(BackendError):
    """The medium cannot be reached right now (Redis down, connection refused, timeout)."""


class CredentialsRefused(BackendUnavailable):
    """A server refused the user or password it was given (Redis ``WRONGPASS`` / ``NOAUTH`` as a
    connection authenticates; an HTTP 401 or 403). To an engine the tier is unavailable like any
    other (a counted miss, never a crash); to a tool it is configuration, which no retry mends
    (the CLI's exit 2). The message names the server by its redacted URL, never the password."""


class InvalidKey(BackendError, ValueError):
    """A key a medium cannot hold: not bytes, empty, or longer than the medium allows."""


class BackendClosed(BackendError, ValueError):
    """A backend was used after ``close()``."""


class StoreClosed(BackendClosed, RuntimeError):
    """The store (its transfer pool) was closed before or during the call. (A RuntimeError too:
    what a closed thread pool raises, and what callers of the pool have always caught.)"""


class UnknownBackend(ConfigError):
    """No storage backend is registered for a URL scheme or name."""


class BlockMismatch(TieredKVError, ValueError):
    """A block handed to the store (to save, or to load into) is not one its host slots hold:
    another shape, size or dtype (its values would be converted), a tensor with no data to copy
    (``meta``, sparse), or a destination that writes one element to several places. Refused,
    never a torch error raised into the engine: a save stores none of its batch's blocks; a load
    may have filled other destinations of its batch first (not to be used: the load failed)."""


class ThreadsUnavailable(TieredKVError, RuntimeError):
    """The system would not start a thread a part of the store needs ("can't start new thread":
    a process or container thread limit). The part is not made, and none of the threads it had
    started is left running. (A RuntimeError too: what ``Thread.start`` raises.)"""

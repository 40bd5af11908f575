"""The Redis key names of stored entries: our prefix, then the entry's key.

In a cluster, Redis hashes only the part of a name between its first ``{`` and the next ``}``
when there is one (a hash tag). Our keys are binary (namespace digest + block key), so about one
namespace in 700 has a digest that forms a tag, and every block of it would go to one slot of one
master. In a cluster a key holding a ``{`` is therefore stored behind an empty tag ``{}`` (an
empty tag hashes the whole name); the tag is taken off again when names are listed. A prefix with
a ``{`` of its own is a deliberate tag (all keys on one slot) and is left alone.
"""

from __future__ import annotations

EMPTY_TAG = b"{}"


class RedisNames:
    """Names of keys under ``prefix``, guarded against accidental hash tags when ``cluster``."""

    def __init__(self, prefix: bytes, cluster: bool) -> None:
        self.prefix = prefix
        self.guard = cluster and b"{" not in prefix

    def name(self, key: bytes) -> bytes:
        if self.guard and b"{" in key:
            return self.prefix + EMPTY_TAG + key
        return self.prefix + key

    def names(self, keys) -> list[bytes]:
        return [self.name(k) for k in keys]

    def key(self, name: bytes) -> bytes:
        """The key a listed ``name`` (under our prefix) stores."""
        rest = name[len(self.prefix) :]
        if self.guard and rest.startswith(EMPTY_TAG) and b"{" in rest[len(EMPTY_TAG) :]:
            return rest[len(EMPTY_TAG) :]
        return rest

    def patterns(self, prefix: bytes) -> list[bytes]:
        """SCAN MATCH patterns for the keys starting with ``prefix``."""
        out = [glob_escape(self.prefix + prefix) + b"*"]
        if self.guard:
            out.append(glob_escape(self.prefix + EMPTY_TAG + prefix) + b"*")
        return out


def glob_escape(data: bytes) -> bytes:
    """``data`` matched literally by a SCAN MATCH pattern."""
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in data)

"""A value given as consecutive buffers, not one: a raw block's head (header and segment table)
and its payload where it already lies (a host slot). A medium that says it takes them
(:attr:`storage_backends.base.Backend.takes_gathered`) writes the parts with one gathered write
(``pwritev``), so the payload is not first copied next to its head; every other path joins them.
The stored bytes are the same either way."""

from __future__ import annotations

from collections.abc import Iterable


class Gathered:
    """The value ``b"".join(parts)``, kept in its parts (views; never copied here)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Iterable) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def nbytes_of(value) -> int:
    """Bytes of a value, gathered or one buffer."""
    return value.nbytes if isinstance(value, Gathered) else memoryview(value).nbytes


def joined(value):
    """A gathered value as one bytes object; any other value as it is."""
    return bytes(value) if isinstance(value, Gathered) else value

"""The Redis tier's command packer: RESP commands whose large arguments go to ``sendall`` as
they are. redis-py's hiredis packer copies each value (pipelined 2 MiB SETs: ~0.5 GB/s with
it, ~0.9-1.0 without). A :class:`~storage_backends.gathered.Gathered` argument (a raw block's
head and the host slot holding its payload) is sent part by part: one bulk string on the wire,
never joined in memory."""

from __future__ import annotations

from typing import Any

from redis.connection import Connection
from redis.exceptions import DataError

from storage_backends.gathered import Gathered

INLINE_ARG = 16 << 10  # command arguments from this size are sent as they are, not copied


def _as_bytes(arg: Any):
    """One command argument as a byte buffer (RESP sends numbers as their text)."""
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, memoryview):
        return arg.cast("B") if arg.format != "B" or arg.ndim != 1 else arg
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return repr(arg).encode()
    if not isinstance(arg, (bytes, bytearray)):
        raise DataError(f"cannot send a {type(arg).__name__} to Redis")
    return arg


def nbytes(value: Any) -> int:
    """Bytes of a value to store (a buffer or bytes)."""
    return value.nbytes if isinstance(value, memoryview) else len(value)


class Packer:
    """RESP command packer that hands large arguments to ``sendall`` without copying them."""

    def pack(self, *args: Any) -> list:
        name = args[0].encode() if isinstance(args[0], str) else bytes(args[0])
        words = [*name.split(), *args[1:]]
        out: list = []
        head = bytearray(b"*%d\r\n" % len(words))
        for arg in words:
            parts = arg.parts if isinstance(arg, Gathered) else [_as_bytes(arg)]
            head += b"$%d\r\n" % sum(len(part) for part in parts)
            for part in parts:  # one bulk string: large parts as they are, small ones inline
                if len(part) >= INLINE_ARG:
                    out += [bytes(head), part]
                    head = bytearray()
                else:
                    head += part
            head += b"\r\n"
        out.append(bytes(head))
        return out


PACKER = Packer()


class PackedConnection(Connection):
    """A TCP connection with :class:`Packer` (the cluster client drops ``command_packer``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"command_packer": PACKER, **kwargs})

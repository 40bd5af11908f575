"""Layer-wise reads of a tier's blocks (:meth:`EncodedTier.read_layered`): every block's head
(header and segment table), then every block's first layer group, then every block's second,
... each part read from the medium when its pass starts (:class:`~storage_backends.base.
RangeReader`), so what the engine needs first arrives first.

A raw frame (the stored bytes of a raw segment of a plain block are its payload) is read
straight into its place in the caller's buffer and checked there; a compressed or sealed frame
is read into a staging buffer and decoded from it into its place. Nothing is mapped: a file
cut short or a disk error during the read is a short or failed read, and the block a miss
(``unreadable``). With ``keep_blobs`` every byte read is kept in one buffer per block, which
comes back as the block's validated stored bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.errors import CorruptBlock
from tiered_kv.store.codec_body import clear
from tiered_kv.store.codec_segments import BlockSegments

HEAD_READS = 6  # the most reads a head takes (a sealed block's: header, frame count, table, frame 0)


def unreadable() -> CorruptBlock:
    """The miss of a block whose stored bytes the medium cannot read (its file cut short, a
    disk error)."""
    return CorruptBlock("stored bytes cannot be read (the medium's file was cut short or the disk failed "
                        "to read them)", reason="unreadable")


class LayeredBlocks:
    """One layer-wise read. Handed: ``head_length(i, prefix, total_len)`` and ``open_block(i,
    head, total_len)`` (the codec's, for the reader's namespace, key and layout), the medium's
    ``sizes`` and ``reader``, the caller's ``outs``, ``fail(i, exc)`` / ``done(i, blob)`` (the
    read's bookkeeping), ``on_ready(indices, raw_end)`` and the first read's length ``probe``."""

    def __init__(self, head_length: Callable[[int, memoryview, int], int],
                 open_block: Callable[[int, memoryview, int], BlockSegments],
                 sizes: Sequence[int | None], reader, outs: Sequence[object],
                 fail: Callable[[int, BaseException], None], done: Callable[[int, object], None],
                 on_ready: Callable[[list[int], int], None], probe: int, keep_blobs: bool) -> None:
        self.head_length, self.open_block = head_length, open_block
        self.sizes, self.reader, self.outs = sizes, reader, outs
        self.fail, self.done, self.on_ready = fail, done, on_ready
        self.probe, self.keep_blobs = probe, keep_blobs
        self.blobs: dict[int, bytearray] = {}  # with keep_blobs: each block's stored bytes
        self._staging = bytearray(0)

    def run(self) -> None:
        opened = self._open_all()
        views = {i: memoryview(self.outs[i]).cast("B") for i in opened}
        position = dict.fromkeys(opened, 0)  # next frame per block
        for cut in sorted({end for block in opened.values() for _, end in block.bounds}):
            due = {i: [j for j in range(position[i], len(block.bounds)) if block.bounds[j][1] <= cut]
                   for i, block in opened.items()}
            self.reader.advise([(i, *opened[i].span(j)) for i, frames in due.items() for j in frames
                                if not opened[i].held(j)])
            ready = []
            for i, block in list(opened.items()):
                try:
                    for j in due[i]:
                        self._frame(i, block, j, views[i])
                        position[i] = j + 1
                        if position[i] == len(block.bounds):  # whole and checked: a hit, whatever follows
                            self.done(i, self.blobs.get(i))
                except _MediumFailed as exc:  # the medium's own failure: a failed read of the tier
                    raise exc.__cause__ from None
                except _Gone:
                    del opened[i]  # (a miss, its reason "absent": nothing wrong with the block)
                    continue
                except Exception as exc:  # whatever a stored block makes decoding do is its fault
                    self.fail(i, exc)
                    del opened[i]
                    continue
                if due[i]:  # its frames up to ``cut`` are in; a block framed otherwise (a frame
                    ready.append(i)  # across ``cut``) is named at its own frames' ends only
            self.on_ready(ready, cut)

    def _open_all(self) -> dict[int, BlockSegments]:
        """Every block's head read (asked for all at once first) and opened."""
        live = [i for i, size in enumerate(self.sizes) if size is not None]
        self.reader.advise([(i, 0, min(self.sizes[i], self.probe)) for i in live])
        opened = {}
        for i in live:
            try:
                opened[i] = self._open(i, self.sizes[i])
            except _MediumFailed as exc:
                raise exc.__cause__ from None
            except _Gone:
                continue
            except Exception as exc:
                self.fail(i, exc)
        return opened

    def _open(self, i: int, size: int) -> BlockSegments:
        buf = bytearray(min(size, self.probe))
        have = 0
        need = len(buf)
        for _ in range(HEAD_READS):
            if need <= have:
                break
            if len(buf) < need:
                buf += bytes(need - len(buf))
            self._read(i, have, memoryview(buf)[have:need])
            have = need
            need = self.head_length(i, memoryview(buf)[:have], size)  # the header checked against size
        else:
            raise CorruptBlock(f"block head still short of {need} bytes after {HEAD_READS} reads")
        if self.keep_blobs:  # (the header said the block is that long)
            blob = self.blobs[i] = bytearray(size)
            blob[:have] = buf[:have]
            buf = blob
        try:
            return self.open_block(i, memoryview(buf)[:have], size)
        except CorruptBlock as exc:
            if exc.reason != "no_key" or have == size:
                raise
        # a sealed block and no key here: every frame's check still tells a damaged block
        # (dropped) from one a replica with the key can read (kept)
        whole = bytearray(size)
        whole[:have] = buf[:have]
        self._read(i, have, memoryview(whole)[have:])
        return self.open_block(i, memoryview(whole), size)  # raises

    def _frame(self, i: int, block: BlockSegments, j: int, view: memoryview) -> None:
        """Frame ``j`` of block ``i`` checked and in its place in ``view``."""
        start, end = block.bounds[j]
        dst = view[start:end]
        if block.held(j):
            block.decode(j, dst)
            return
        lo, hi = block.span(j)
        blob = self.blobs.get(i)
        if blob is not None:
            stored = memoryview(blob)[lo:hi]
        elif block.in_place(j):
            self._read(i, lo, dst)
            block.check_in_place(j, dst)
            return
        else:
            if len(self._staging) < hi - lo:
                self._staging = bytearray(hi - lo)
            stored = memoryview(self._staging)[: hi - lo]
        self._read(i, lo, stored)
        block.decode(j, dst, stored)

    def _read(self, i: int, start: int, into: memoryview) -> None:
        """``into`` filled from block ``i``'s stored bytes at ``start``; on failure cleared
        (no unchecked byte stays in a caller's buffer) and raised: CorruptBlock (unreadable),
        _Gone, or _MediumFailed."""
        try:
            status = self.reader.read(i, start, into)
        except Exception as exc:
            clear(into)  # (part of it may have arrived)
            raise _MediumFailed from exc
        if status is True:
            return
        clear(into)
        if status is None:
            raise _Gone
        raise unreadable()


class _MediumFailed(Exception):
    """The medium failed a read as a whole (its ``__cause__``): not the block's fault."""


class _Gone(Exception):
    """The medium no longer holds the block (deleted since the read began): a miss."""

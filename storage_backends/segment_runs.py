"""Runs of values lying one after the other in a segment file, each read or written with one
gathered system call (``preadv`` / ``pwritev``): small blocks then cost a call, and a release
of the GIL, per run instead of per block. Runs stop at ``RUN_BYTES``, so 2 MiB blocks still
move one per call (a 16 MiB run measured no faster, warm or cold)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from storage_backends.lmdb_segments import Place

RUN_BYTES = 1 << 20  # a run holds at most this many bytes of values
RUN_VALUES = 256  # ... and this many values (three pieces each at most: the limit is 1024, IOV_MAX)


def runs(places: Sequence[Place | None], max_gap: int,
         fits: Callable[[int], bool] = lambda i: True) -> list[list[int]]:
    """The indices of ``places`` in order, grouped: places for which ``fits(i)`` holds, in one
    segment, each starting under ``max_gap`` bytes after the one before ends, form runs; every
    other index (None among them) is a group of its own."""
    groups: list[list[int]] = []
    last: Place | None = None
    size = 0
    for i, place in enumerate(places):
        if place is None or place.length > RUN_BYTES or not fits(i):
            groups.append([i])
            last = None
            continue
        if last is not None and place.segment == last.segment and \
                0 <= place.offset - (last.offset + last.length) < max_gap and \
                size + place.length <= RUN_BYTES and len(groups[-1]) < RUN_VALUES:
            groups[-1].append(i)
            size += place.length
        else:
            groups.append([i])
            size = place.length
        last = place
    return groups

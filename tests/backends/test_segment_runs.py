"""Which values of a segment are read or written together (storage_backends.segment_runs): runs
of values lying one after the other, cut at a gap, a change of segment, RUN_BYTES or
RUN_VALUES; a value that is absent or does not fit the caller's rule stands alone."""

from __future__ import annotations

from storage_backends.lmdb_segments import Place
from storage_backends.segment_runs import RUN_BYTES, RUN_VALUES, runs

KiB = 1 << 10


def back_to_back(segment: int, n: int, length: int, pad: int = 0, start: int = 0) -> list[Place]:
    return [Place(segment, start + i * (length + pad), length) for i in range(n)]


def test_values_one_after_the_other_form_runs_of_at_most_run_bytes():
    places = back_to_back(1, 40, 64 * KiB, pad=28)
    got = runs(places, 64)
    per_run = RUN_BYTES // (64 * KiB)
    assert [len(r) for r in got] == [per_run, per_run, 40 - 2 * per_run]
    assert [i for r in got for i in r] == list(range(40)), "every index once, in order"


def test_a_gap_too_wide_a_step_back_or_another_segment_starts_a_new_run():
    places = [Place(1, 0, 100), Place(1, 100, 100), Place(1, 300, 100), Place(1, 0, 100),
              Place(2, 100, 100), Place(2, 200, 100)]
    assert runs(places, 64) == [[0, 1], [2], [3], [4, 5]]
    assert runs(places, 101) == [[0, 1, 2], [3], [4, 5]]


def test_absent_or_unfit_values_and_values_over_run_bytes_stand_alone():
    places = [Place(1, 0, 100), None, Place(1, 100, 100), Place(1, 200, 100), Place(1, 300, RUN_BYTES + 1)]
    assert runs(places, 64) == [[0], [1], [2, 3], [4]]
    assert runs(places, 64, fits=lambda i: i != 2) == [[0], [1], [2], [3], [4]]


def test_a_run_holds_at_most_run_values_values():
    places = back_to_back(1, RUN_VALUES + 5, 16)
    assert [len(r) for r in runs(places, 64)] == [RUN_VALUES, 5]

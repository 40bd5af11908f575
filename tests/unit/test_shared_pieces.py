"""A synchronous load's blocks shared by its threads: every block handed out once, large pieces
first and small ones last, never below the least piece but for what is left."""

import threading

import pytest

from tiered_kv.store.shared_pieces import SharedPieces


def test_threads_taking_at_once_get_every_index_exactly_once_in_ascending_pieces():
    pieces = SharedPieces(10_000, threads=4, least=3)
    got: list[list[range]] = [[] for _ in range(4)]
    go = threading.Barrier(4, timeout=10)

    def take(mine: list[range]) -> None:
        go.wait()
        while (piece := pieces.take()) is not None:
            mine.append(piece)

    threads = [threading.Thread(target=take, args=(g,), daemon=True) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    every = sorted((p for g in got for p in g), key=lambda p: p.start)
    assert [i for p in every for i in p] == list(range(10_000))
    assert all(a.stop == b.start for a, b in zip(every, every[1:]))
    assert pieces.take() is None


def test_pieces_shrink_from_a_share_of_what_is_left_to_the_least():
    pieces = SharedPieces(32, threads=2, least=2)
    sizes = []
    while (piece := pieces.take()) is not None:
        sizes.append(len(piece))
    assert sizes == [8, 6, 5, 4, 3, 2, 2, 2]  # ceil(left / 4), never under 2
    assert sum(sizes) == 32


def test_the_last_piece_is_what_is_left_even_below_the_least():
    pieces = SharedPieces(5, threads=1, least=4)
    assert [len(p) for p in iter(pieces.take, None)] == [4, 1]


def test_nothing_to_share_hands_out_nothing():
    assert SharedPieces(0, threads=2).take() is None


@pytest.mark.parametrize("count, threads, least", [(-1, 1, 1), (4, 0, 1), (4, 2, 0)])
def test_a_nonsense_share_is_refused(count, threads, least):
    with pytest.raises(ValueError):
        SharedPieces(count, threads, least)

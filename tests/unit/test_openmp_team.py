"""The host copier's threads copy with an OpenMP team of one, and only while they copy: torch's
``stack`` then takes its serial memcpy kernel (with a team of two it copied each small block
through a copy iterator of its own), and the engine's threads keep their teams."""

from __future__ import annotations

import threading

import pytest
import torch

from tiered_kv.store.host_copy import HostCopier
from tiered_kv.store.openmp_team import find_openmp, one_thread_team

pytestmark = pytest.mark.skipif(find_openmp() is None, reason="torch loaded no OpenMP runtime here")


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_thread_in_a_team_of_one_runs_torch_alone_and_the_others_keep_their_teams(two_torch_threads):
    inside, entered, leave = [], threading.Event(), threading.Event()

    def worker():
        with one_thread_team():
            inside.append(torch.get_num_threads())
            entered.set()
            leave.wait(10)
        inside.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    assert torch.get_num_threads() == 2, "another thread's limit reached this one"
    leave.set()
    t.join(10)
    assert inside == [1, 2]


def test_a_fresh_thread_keeps_its_team_of_one_through_torchs_first_parallel_call(two_torch_threads):
    """torch sets a thread's team size at its first parallel call: inside the limit, that
    first call must not undo it."""
    seen = []

    def worker():
        with one_thread_team():
            torch.ones(1 << 16).add_(1)  # a first parallel call on this thread
            seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert seen == [1]


def test_every_thread_copying_a_batch_of_small_blocks_does_it_with_a_team_of_one(two_torch_threads, monkeypatch):
    teams, real = [], torch.stack

    def stack(*args, **kwargs):
        teams.append((threading.get_ident(), torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", stack)
    copier = HostCopier(2, min_bytes=0)
    try:
        blocks = [torch.full((64, 64), float(i)) for i in range(64)]
        rows = torch.empty(64, 64, 64)
        copier.copy_runs([(rows[lo:lo + 8], blocks[lo:lo + 8]) for lo in range(0, 64, 8)], into_slots=True)
    finally:
        copier.close()
    assert all(torch.equal(rows[i], blocks[i]) for i in range(64))
    assert len(teams) == 8 and {n for _, n in teams} == {1}
    assert torch.get_num_threads() == 2, "the caller's team was not given back"


def test_making_a_copier_leaves_the_callers_team_as_it_was(two_torch_threads):
    HostCopier(2).close()
    assert torch.get_num_threads() == 2

"""A lookup whose helper thread could not be started ("can't start new thread", a process at
its thread limit for a moment) is one miss of that tier, never the tier's end: the next lookup
starts the helper and finds the blocks again."""

from __future__ import annotations

import threading

from tests.store.helpers import keys_for, make_store, payloads


def test_regression_a_lookup_thread_refused_once_left_the_disk_tier_a_miss_for_good(tmp_path, monkeypatch):
    keys = keys_for(4)
    with make_store(tmp_path) as store:
        store.save(keys, payloads(store, 4))
        store.flush()
    with make_store(tmp_path, lookup_timeout=5.0) as store:  # an empty host tier: only disk holds them
        start = threading.Thread.start

        def refused(thread):
            if thread.name.startswith("tiered-kv-lookup-"):
                raise RuntimeError("can't start new thread")
            return start(thread)

        monkeypatch.setattr(threading.Thread, "start", refused)
        assert store.lookup(keys) == 0, "no helper thread: the tier answers nothing this time"
        monkeypatch.setattr(threading.Thread, "start", start)
        # the old code kept the unstarted thread: every later lookup queued a job nobody ran,
        # waited out its deadline, then skipped the tier as "still waiting" for ever
        assert store.lookup(keys) == 4
        assert store.lookup(keys) == 4
        assert store.metrics.misses("lookup_timeout") == 0

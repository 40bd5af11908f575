"""The connector driving the reference engine: save, restart, load, corrupt, async, slow tiers."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from storage_backends import registry
from storage_backends.registry import register_backend
from tests.connector.engine_helpers import GREEDY, connector, engine, prompt, reference
from tests.store.helpers import rewrite_stored_blocks

BS = 16


def test_second_engine_loads_every_full_block_but_the_last_token_and_outputs_match(tmp_path):
    prompts = [prompt(300, seed=1), prompt(160, seed=2)]  # 160 = exactly 10 blocks
    conn = connector(tmp_path / "db")
    first = engine(conn).generate(prompts, GREEDY)
    conn.close()

    conn = connector(tmp_path / "db")  # a fresh store on the same LMDB path: host tier is empty
    second = engine(conn).generate(prompts, GREEDY)
    assert [o.num_external_tokens for o in second] == [(300 // BS) * BS, 160 - BS]
    assert [o.num_prefilled_tokens for o in second] == [300 - 288, BS]
    assert [o.output_token_ids for o in second] == [o.output_token_ids for o in first] == reference(prompts)
    assert conn.worker.load_stats[second[0].request_id] == {"disk": 18}
    conn.close()


def test_generated_tokens_are_saved_too_so_a_follow_up_turn_hits_them(tmp_path):
    conn = connector(tmp_path / "db")
    turn1 = prompt(100)
    out = engine(conn).generate([turn1], GREEDY.__class__(max_tokens=40, temperature=0.0))[0]
    conn.close()
    turn2 = turn1 + out.output_token_ids + prompt(30, seed=9)
    conn = connector(tmp_path / "db")
    [again] = engine(conn).generate([turn2], GREEDY)
    # prompt + all generated tokens but the last (whose KV is never computed) lie in saved blocks
    assert again.num_external_tokens == ((100 + 40 - 1) // BS) * BS
    assert again.output_token_ids == reference([turn2])[0]
    conn.close()


def _flip_all_blocks(path) -> int:
    return rewrite_stored_blocks(path, lambda k, v: v[:200] + bytes([v[200] ^ 0xFF]) + v[201:])


@pytest.mark.parametrize("load_async", [False, True])
def test_corrupted_blocks_between_runs_are_recomputed_and_counted(tmp_path, load_async):
    prompts = [prompt(200)]
    conn = connector(tmp_path / "db")
    engine(conn).generate(prompts, GREEDY)
    conn.close()
    assert _flip_all_blocks(tmp_path / "db") == 200 // BS

    conn = connector(tmp_path / "db", load_async=load_async)
    [out] = engine(conn).generate(prompts, GREEDY)
    assert out.output_token_ids == reference(prompts)[0]
    assert out.num_external_tokens == 0
    assert out.num_prefilled_tokens >= 200  # a failed sync load is noticed after its step
    assert conn.store.metrics.misses("corrupt") == 200 // BS
    conn.close()
    # the recomputed blocks were saved again: a third run hits them all
    conn = connector(tmp_path / "db")
    [third] = engine(conn).generate(prompts, GREEDY)
    assert third.num_external_tokens == (200 // BS) * BS - (BS if 200 % BS == 0 else 0)
    conn.close()


def test_async_loads_complete_through_get_finished_with_identical_output(tmp_path):
    prompts = [prompt(400, seed=3), prompt(250, seed=4)]
    conn = connector(tmp_path / "db")
    engine(conn).generate(prompts, GREEDY)
    conn.close()
    conn = connector(tmp_path / "db", load_async=True)
    outs = engine(conn).generate(prompts, GREEDY)
    assert [o.num_external_tokens for o in outs] == [(400 - 1) // BS * BS, (250 - 1) // BS * BS]
    assert [o.output_token_ids for o in outs] == reference(prompts)
    conn.close()


class _HeldPuts:
    """An LMDB tier whose puts wait until the test lets them through: an arbitrarily slow tier."""

    gate = threading.Event()
    finished = 0  # puts that completed


def _held_lmdb_class():
    from storage_backends.lmdb_disk import LmdbBackend

    class HeldLmdb(LmdbBackend):
        @classmethod
        def from_url(cls, url, **options):
            return super().from_url("lmdb" + url[len("heldlmdb"):], **options)

        def put_many(self, items, tenant=b""):
            _HeldPuts.gate.wait(60)
            _HeldPuts.finished += 1
            return super().put_many(items, tenant)

    return HeldLmdb


def test_forward_pass_is_not_blocked_by_saves_to_a_slow_tier(tmp_path, monkeypatch):
    import tests.connector.test_connector_engine as me

    me.HeldLmdb = _held_lmdb_class()
    # (restored after: a medium left registered made later tests' store lookups ask it too)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_backend("heldlmdb", "tests.connector.test_connector_engine:HeldLmdb")
    monkeypatch.setattr(_HeldPuts, "gate", threading.Event())
    monkeypatch.setattr(_HeldPuts, "finished", 0)
    prompts = [prompt(320, seed=s) for s in range(3)]
    conn = connector(None, disk_url=f"heldlmdb://{tmp_path}/db")
    outs = engine(conn).generate(prompts, GREEDY)
    assert _HeldPuts.finished == 0, "generate waited for a save to the slow tier"
    assert [o.output_token_ids for o in outs] == reference(prompts)
    _HeldPuts.gate.set()
    conn.close()  # flushes the write-behind: this is where the held puts complete
    assert _HeldPuts.finished > 0


def test_scheduler_half_never_imports_torch():
    code = ("import sys, tiered_kv.connector.scheduler, tiered_kv.connector.meta, tiered_kv.keys;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

"""Two replicas of vLLM's real engine on CPU sharing one Redis (``pytest -m vllm``;
``tools/check_vllm.sh`` runs it): each replica is its own process with its own host and LMDB
tiers; what replica A served is a cross-replica hit on replica B, which never saw the prompts,
and B generates A's tokens."""

from __future__ import annotations

import pytest

from tests.integrations.test_vllm_engine import loadable_tokens, result

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM's real engine: run tools/check_vllm.sh")


def replica(tmp_path, name: str, redis_url: str) -> dict:
    """One replica: its own disk tier under ``tmp_path / name``, the shared remote."""
    home = tmp_path / name
    home.mkdir()
    return result(home, extra={"remote": {"url": redis_url}})


def test_replica_b_is_served_what_replica_a_computed_through_the_shared_redis(tmp_path, redis_url):
    a = replica(tmp_path, "a", redis_url)
    assert a["cached_tokens"] == [0] * len(a["prompt_tokens"])
    b = replica(tmp_path, "b", redis_url)  # an empty disk tier of its own: every hit is remote
    assert b["cached_tokens"] == [loadable_tokens(n) for n in b["prompt_tokens"]]
    assert b["outputs"] == a["outputs"]


def test_a_replica_whose_shared_redis_was_flushed_recomputes_the_same_tokens(tmp_path, redis_server, redis_url):
    a = replica(tmp_path, "a", redis_url)
    redis_server.flushall()
    b = replica(tmp_path, "b", redis_url)
    assert b["cached_tokens"] == [0] * len(b["prompt_tokens"])
    assert b["outputs"] == a["outputs"]

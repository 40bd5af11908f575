"""Two replicas of one model, each with its own host and disk tiers, sharing one real Redis
Cluster: what replica A served is a cross-replica hit on replica B, with the same outputs, and
``explain`` over B's tiers names the remote tier as where the blocks are. (Two engines in this
test process, each with its own store; the fault soak runs engines in two processes on one Redis.)"""

from __future__ import annotations

from tests.cli.conftest import cli
from tests.cluster.helpers import LOOKUP_S
from tests.connector.engine_helpers import ENGINE, GREEDY, MODEL, connector, engine, prompt, reference
from tiered_kv.engine import engine_namespace, weights_revision

BS = 16


def test_prompts_served_by_one_replica_are_cross_replica_hits_on_another(redis_cluster, tmp_path):
    remote = {"url": redis_cluster.url}
    prompts = [prompt(300, seed=21), prompt(160, seed=22)]
    replica_a = connector(tmp_path / "a", remote=remote, lookup_timeout=LOOKUP_S)
    first = engine(replica_a).generate(prompts, GREEDY)
    replica_a.close()  # its write-behind to the cluster has ended

    connector(tmp_path / "b", remote=remote, lookup_timeout=LOOKUP_S).close()  # B's tiers, empty
    config = tmp_path / "b.toml"  # B's lower tiers, as an operator would point explain at them
    config.write_text(f'[disk]\nurl = "lmdb://{tmp_path}/b"\n\n[remote]\nurl = "{redis_cluster.url}"\n')
    digest = engine_namespace(MODEL, ENGINE, weights_revision(MODEL, seed=0)).digest().hex()
    explained = cli("explain", "--json", "--config", config, "--namespace", digest[:16],
                    "--token-ids", ",".join(map(str, prompts[0])))
    assert explained.code == 0, explained.err
    report = explained.json()
    assert report["matched_blocks"] == 300 // BS
    assert {b["tier"] for b in report["blocks"]} == {"remote"}  # where B would load them from

    replica_b = connector(tmp_path / "b", remote=remote, lookup_timeout=LOOKUP_S)
    second = engine(replica_b).generate(prompts, GREEDY)
    assert [o.num_external_tokens for o in second] == [(300 // BS) * BS, 160 - BS]
    assert [o.output_token_ids for o in second] == [o.output_token_ids for o in first] == reference(prompts)
    assert replica_b.worker.load_stats[second[0].request_id] == {"remote": 18}
    replica_b.close()

"""The reference engine over encrypted tiers: with the secret, restored prefixes give the same
outputs as computing them and arrive layer group by layer group (each sealed frame opened on its
own); a replica without the secret, or with another, counts misses, recomputes, and its outputs
are still identical."""

from __future__ import annotations

import pytest
import torch

from tests.connector.engine_helpers import GREEDY, connector, engine, prompt, reference
from tests.connector.test_layerwise_loads import BLOCKS, NS, _start, layers_arrive_in_order
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector.worker import ConnectorWorker
from tiered_kv.keys import block_keys
from tiered_kv.store import TieredStore
from tiered_kv.store.codec import BlockCodec

SECRET = "the fleet's encryption secret"
OTHER = "some other fleet's secret key"


def _config(path, secret: str | None) -> TieredKVConfig:
    return TieredKVConfig.from_dict({"host": {"capacity": "16MiB"}, "workers": 2, "encryption_secret": secret,
                                     "layerwise_loads": True,
                                     "disk": {"url": f"lmdb://{path}", "capacity": "64MiB"}})


def _payloads(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    scale = torch.rand(NS.block_shape[-2:], generator=g) * 3
    return [(torch.randn(NS.block_shape, generator=g) * scale).to(torch.bfloat16) for _ in range(n)]


def _worker(path, secret: str | None) -> tuple[ConnectorWorker, torch.Tensor]:
    worker = ConnectorWorker(TieredStore(_config(path, secret), NS))
    kv = torch.zeros((2, NS.num_layers, 16, NS.block_size, NS.num_kv_heads, NS.head_dim), dtype=torch.bfloat16)
    worker.register_kv_caches(kv)
    return worker, kv


def test_layerwise_loads_open_each_sealed_frame_before_its_layers_are_used(tmp_path):
    keys = block_keys(NS, list(range(BLOCKS * NS.block_size)))
    payloads = _payloads(BLOCKS)
    with TieredStore(_config(tmp_path / "db", SECRET), NS) as store:
        store.save(keys, payloads)
        assert store.flush(30)
    seen = []
    rewrite_stored_blocks(tmp_path / "db", lambda k, v: seen.append(BlockCodec.read_header(v)))
    assert len(seen) == BLOCKS and all(h.sealed and h.segmented for h in seen)
    worker, kv = _worker(tmp_path / "db", SECRET)
    layers_arrive_in_order(worker, kv, keys, payloads, [5, 2, 8, 0, 13, 6])


@pytest.mark.parametrize(("secret", "reason"), [(None, "no_key"), (OTHER, "wrong_key")])
def test_layerwise_loads_without_the_key_fail_every_block_and_write_nothing(tmp_path, secret, reason):
    keys = block_keys(NS, list(range(BLOCKS * NS.block_size)))
    with TieredStore(_config(tmp_path / "db", SECRET), NS) as store:
        store.save(keys, _payloads(BLOCKS))
        assert store.flush(30)
    worker, kv = _worker(tmp_path / "db", secret)
    _start(worker, keys, range(BLOCKS))
    for layer in range(NS.num_layers):
        worker.wait_for_layer_load(layer)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set(range(BLOCKS))
    assert not kv.any()
    assert worker.store.metrics.misses(reason) == BLOCKS
    worker.close()
    worker.store.close()


def test_reference_engine_outputs_are_identical_with_the_key_and_without_it(tmp_path):
    """A replica without the secret leaves the sealed blocks in place; one with another secret
    (a rotated one) replaces those it recomputes, and then the old secret's replica recomputes."""
    prompts = [prompt(300, seed=21), prompt(170, seed=22)]
    want = reference(prompts)

    def run(secret, reason=None, external=None):
        conn = connector(tmp_path / "db", encryption_secret=secret)
        out = engine(conn).generate(prompts, GREEDY)
        assert [o.output_token_ids for o in out] == want
        if reason is None:
            assert conn.store.metrics.misses() == 0
        else:
            assert conn.store.metrics.misses(reason) > 0
        assert conn.store.metrics.misses("corrupt") == 0
        if external is not None:
            assert [o.num_external_tokens for o in out] == external
        conn.close()

    run(SECRET)
    run(None, "no_key")
    run(SECRET, external=[288, 160])  # the blocks were left in place
    run(OTHER, "wrong_key")
    run(OTHER, external=[288, 160])  # ... and replaced by the blocks it recomputed
    run(SECRET, "wrong_key")

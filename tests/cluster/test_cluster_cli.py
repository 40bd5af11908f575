"""The tools on a cluster URL: ``inspect``, ``verify``, ``explain`` and ``copy`` see a namespace's
blocks on every master of a real Redis Cluster as one store."""

from __future__ import annotations

from tests.cli.conftest import cli
from tests.cluster.helpers import LOOKUP_S, bit_exact_loads
from tests.store.helpers import NS, keys_for, make_store, payloads

N = 24


def test_inspect_verify_explain_and_copy_work_against_a_cluster_url(redis_cluster, tmp_path):
    tokens = list(range(50_000, 50_000 + N * NS.block_size))
    keys = keys_for(N, first_token=50_000)
    with make_store(host="64KiB", disk=None, remote_url=redis_cluster.url, lookup_timeout=LOOKUP_S) as store:
        data = payloads(store, N, seed=11)
        store.save(keys, data)
        store.flush()
    url = redis_cluster.url

    report = cli("inspect", "--json", url).json()
    namespaces = report["tiers"][0]["namespaces"]
    assert namespaces[NS.digest().hex()]["blocks"] == N

    verified = cli("verify", "--json", url)
    assert verified.code == 0, verified.out + verified.err

    explained = cli("explain", "--json", "--token-ids", ",".join(map(str, tokens)), url)
    assert explained.code == 0, explained.err
    found = explained.json()
    assert found["stored_blocks"] == N and found["matched_blocks"] == N - 1  # the last token is computed

    copied = cli("copy", url, f"lmdb://{tmp_path}/copy")
    assert copied.code == 0, copied.err
    with make_store(tmp_path, host="64KiB", disk={"url": f"lmdb://{tmp_path}/copy"}) as local:
        assert all(bit_exact_loads(local, keys, data))

"""Models with several KV cache groups through both connector halves, over a real LMDB store:
sliding-window + full attention (Gemma-style), MLA latents, and a hybrid of attention and
recurrent state (Mamba-style). Engine A computes and saves; engine B (a new store on the same
directory) matches, loads into its own blocks and must find exactly A's values."""

from __future__ import annotations

import pytest
import torch

from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.config import TieredKVConfig
from tiered_kv.connector import build_connector
from tiered_kv.connector.group_layout import GroupLayout
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.common import RequestStep, RequestView, StepOutput
from tiered_kv.keys import Namespace
from tiered_kv.kv_groups import KVGroup

BS, H, D, NB = 4, 2, 8, 24
PROMPT = list(range(500, 500 + 6 * BS + 1))  # six full blocks and one token
SLIDING = KVGroup("sliding", 2, (2, H, D), "float32", BS, window=2 * BS)
FULL = KVGroup("full", 2, (2, H, D), "float32", BS)
MLA = KVGroup("mla", 3, (12,), "float32", BS)
STATE = KVGroup("state", 2, (40,), "float32", 64)


def namespace(*groups: KVGroup) -> Namespace:
    return Namespace("groups-test", "float32", sum(g.num_layers for g in groups), H, D, BS, groups=groups)


def tensors(group: KVGroup, seed: int) -> list[torch.Tensor]:
    """The engine's per-layer tensors of one group, filled with distinct values."""
    gen = torch.Generator().manual_seed(seed)
    if group.kind == "mla":
        shape = (NB, BS, group.shape[0])
    elif group.is_state:
        shape = (NB, *group.shape)
    else:
        shape = (NB, 2, BS, H, D)
    return [torch.randn(shape, generator=gen) for _ in range(group.num_layers)]


def connector(tmp_path, ns: Namespace):
    config = TieredKVConfig.from_dict({"host": {"capacity": "4MiB"}, "workers": 2,
                                       "disk": {"url": f"lmdb://{tmp_path}/db", "capacity": "64MiB"}})
    return build_connector(config, ns)


def request(rid: str) -> RequestView:
    return RequestView(rid, list(PROMPT), len(PROMPT), None)


def run_step(conn, rid, ids, computed, scheduled, *, new=True):
    step = RequestStep(rid, list(PROMPT) if new else [], ids, computed, scheduled)
    meta = conn.scheduler.build_connector_meta(StepOutput([step] if new else [], [] if new else [step]))
    conn.worker.bind_connector_meta(meta)
    conn.worker.start_load_kv()
    conn.worker.wait_for_save()
    return meta


def fill_store(tmp_path, ns, kv, ids, steps):
    """Engine A: prefill in ``steps`` (tokens per step), saving what each step completes."""
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(kv)
    assert conn.get_num_new_matched_tokens(request("a"), 0) == (0, False)
    conn.update_state_after_alloc(request("a"), ids, 0)
    done = 0
    for i, n in enumerate(steps):
        run_step(conn, "a", ids if i == 0 else [[] for _ in ids], done, n, new=i == 0)
        done += n
    conn.request_finished(request("a"), ids)
    conn.close()


def test_sliding_and_full_groups_load_every_kept_block_and_skip_blocks_behind_the_window(tmp_path):
    ns = namespace(SLIDING, FULL)
    a = [tensors(SLIDING, 1), tensors(FULL, 2)]
    ids_a = [list(range(1, 8)), list(range(8, 15))]
    fill_store(tmp_path, ns, a, ids_a, [len(PROMPT)])
    b = [[torch.zeros_like(t) for t in g] for g in a]
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(b)
    n, _ = conn.get_num_new_matched_tokens(request("b"), 0)
    assert n == 6 * BS
    # the engine keeps only the window's blocks of the sliding group: -1 before it
    ids_b = [[-1, -1, -1, -1, 20, 21, 22], [10, 11, 12, 13, 14, 15, 16]]
    conn.update_state_after_alloc(request("b"), ids_b, n)
    run_step(conn, "b", ids_b, 0, 1)
    assert conn.get_block_ids_with_load_errors() == set()
    for layer in range(2):
        for i in range(6):
            assert torch.equal(b[1][layer][ids_b[1][i]], a[1][layer][ids_a[1][i]])
        for i in (4, 5):
            assert torch.equal(b[0][layer][ids_b[0][i]], a[0][layer][ids_a[0][i]])
        assert not b[0][layer][:20].any()  # nothing written outside the window's blocks
    conn.close()


def test_mla_latents_round_trip_per_token_block(tmp_path):
    ns = namespace(MLA)
    a = [tensors(MLA, 3)]
    conn, b = _latents_loaded(tmp_path, ns, a)
    for layer in range(3):
        assert torch.equal(b[0][layer][9:15], a[0][layer][1:7])
    conn.close()


def _latents_loaded(tmp_path, ns, a):
    """Blocks 1..6 of ``a`` stored, then matched and loaded into blocks 9..14 of a fresh engine's
    zeroed tensors: (its connector, its tensors)."""
    fill_store(tmp_path, ns, a, [list(range(1, 8))], [len(PROMPT)])
    b = [[torch.zeros_like(t) for t in a[0]]]
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(b)
    n, _ = conn.get_num_new_matched_tokens(request("b"), 0)
    assert n == 6 * BS
    conn.update_state_after_alloc(request("b"), [list(range(9, 16))], n)
    run_step(conn, "b", [list(range(9, 16))], 0, 1)
    return conn, b


def hybrid_store(tmp_path, steps):
    ns = namespace(FULL, STATE)
    a = [tensors(FULL, 4), tensors(STATE, 5)]
    fill_store(tmp_path, ns, a, [list(range(1, 8)), [9]], steps)
    return ns, a


def test_hybrid_hit_ends_on_the_last_block_whose_state_was_saved(tmp_path):
    # steps end at 2 and 4 blocks, then the rest: states exist at blocks 2 and 4 only
    ns, a = hybrid_store(tmp_path, [2 * BS, 2 * BS, len(PROMPT) - 4 * BS])
    b = [[torch.zeros_like(t) for t in a[0]], [torch.zeros_like(t) for t in a[1]]]
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(b)
    n, _ = conn.get_num_new_matched_tokens(request("b"), 0)
    assert n == 4 * BS  # six blocks are stored, but the state is held at the end of block 4
    ids_b = [list(range(10, 17)), [3]]
    conn.update_state_after_alloc(request("b"), ids_b, n)
    run_step(conn, "b", ids_b, 0, len(PROMPT) - n)
    assert conn.get_block_ids_with_load_errors() == set()
    for layer in range(2):
        assert torch.equal(b[0][layer][10:14], a[0][layer][1:5])
        assert torch.equal(b[1][layer][3], a[1][layer][9])  # A's state slot after its second step
    assert conn.store.stats()["tiers"]["disk"]["hits"] == 5  # four block entries and one state entry
    conn.close()


def test_hybrid_without_any_block_boundary_state_claims_nothing(tmp_path):
    ns, a = hybrid_store(tmp_path, [len(PROMPT)])  # one step ending mid-block: no state saved
    conn = connector(tmp_path, ns)
    assert conn.get_num_new_matched_tokens(request("b"), 0) == (0, False)
    conn.close()


def test_a_corrupt_state_entry_fails_the_whole_load_so_the_engine_recomputes_from_token_zero(tmp_path):
    ns, a = hybrid_store(tmp_path, [2 * BS, 2 * BS, len(PROMPT) - 4 * BS])
    state_keys = set()
    from tiered_kv.keys import block_keys

    for k in block_keys(ns, PROMPT):
        state_keys.add(ns.digest() + ns.state_key(k))

    def flip(storage_key, value):
        return value[:-5] + bytes([value[-5] ^ 0x44]) + value[-4:] if storage_key in state_keys else None

    assert rewrite_stored_blocks(tmp_path / "db", flip) == 2
    b = [[torch.zeros_like(t) for t in a[0]], [torch.zeros_like(t) for t in a[1]]]
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(b)
    n, _ = conn.get_num_new_matched_tokens(request("b"), 0)
    assert n == 4 * BS  # presence alone does not reveal corruption
    ids_b = [list(range(10, 17)), [3]]
    conn.update_state_after_alloc(request("b"), ids_b, n)
    run_step(conn, "b", ids_b, 0, len(PROMPT) - n)
    assert conn.get_block_ids_with_load_errors() == {10, 11, 12, 13}  # every loaded block
    assert not b[1][0][3].any() and not b[0][0][10:14].any()  # nothing scattered
    assert conn.store.metrics.misses("corrupt") == 1
    conn.close()


def test_namespaces_without_groups_keep_their_digest_and_groups_change_it():
    plain = Namespace("m", "float32", 4, H, D, BS)
    assert plain.digest().hex() == "24b6b920b41b37c4d2ee99a88e704f8f"  # as before groups existed
    assert namespace(SLIDING, FULL).digest() != namespace(FULL, FULL).digest()
    assert Namespace.from_dict(namespace(FULL, STATE).describe()) == namespace(FULL, STATE)


@pytest.mark.parametrize("groups, message", [
    ((STATE,), "at least one token group"),
    ((KVGroup("full", 2, (2, H, D), "float32", 2 * BS),), "pages 8"),
])
def test_namespaces_with_groups_refuse_what_keys_cannot_cover(groups, message):
    with pytest.raises(ConfigError, match=message):
        namespace(*groups)


def test_registering_the_wrong_tensors_for_a_group_is_one_config_error(tmp_path):
    ns = namespace(FULL, STATE)
    conn = connector(tmp_path, ns)
    bad_state = [torch.zeros(NB, 39) for _ in range(2)]
    with pytest.raises(ConfigError, match=r"KV group 1 \(state\)"):
        conn.worker.register_kv_caches([tensors(FULL, 1), bad_state])
    with pytest.raises(ConfigError, match="one entry per group"):
        conn.worker.register_kv_caches({f"layers.{i}": t for i, t in enumerate(tensors(FULL, 1))})
    conn.close()


def test_regression_state_rows_registered_closer_than_a_row_apart_overlapped_on_every_copy():
    # rows of a state tensor must not overlap: one whose row stride is below the row size (an
    # expanded tensor, an odd view) passed every check, so a row's copy read and wrote its
    # neighbours' values
    ns = namespace(FULL, STATE)
    row = STATE.shape[0]
    flat = torch.zeros(NB * row)
    for bad in (flat.as_strided((NB, row), (row // 2, 1)), torch.zeros(1, row).expand(NB, row)):
        with pytest.raises(ConfigError, match=r"KV group 1 \(state\).* rows overlap"):
            GroupLayout(ns, [tensors(FULL, 1), [bad, bad]])
    # rows apart by more than a row (vLLM's state rows at the start of padded pages) are fine
    pages = [torch.arange(NB * 2 * row, dtype=torch.float32).view(NB, 2 * row) + 1000 * i for i in range(2)]
    before = [p.clone() for p in pages]
    layout = GroupLayout(ns, [tensors(FULL, 1), [p[:, :row] for p in pages]])
    layout.scatter_state(torch.tensor([[5]]), layout.gather_state(torch.tensor([[3]])))
    for p, old in zip(pages, before):
        assert torch.equal(p[5, :row], old[3, :row])  # row 3 copied into row 5
        p[5, :row] = old[5, :row]
        assert torch.equal(p, old)  # and nothing else written, the padding included


def test_the_cli_shows_groups_and_explains_a_hybrid_hit_cut_where_no_state_is_held(tmp_path):
    from tests.cli.conftest import cli


    hybrid_store(tmp_path, [2 * BS, 2 * BS, len(PROMPT) - 4 * BS])
    url = f"lmdb://{tmp_path}/db"
    (ns_report,) = cli("inspect", url, "--json").json()["tiers"][0]["namespaces"].values()
    assert [g["kind"] for g in ns_report["groups"]] == ["full", "state"]
    report = cli("explain", url, "--token-ids", ",".join(map(str, PROMPT)), "--json").json()
    assert report["matched_blocks"] == 4 and report["first_miss"]["reason"] == "no_state"
    assert [b["state"] for b in report["blocks"][:4]] == [None, "store", None, "store"]  # the tier named by URL
    assert cli("verify", url).code == 0  # block and state entries alike pass their checks


def test_mla_latents_are_stored_once_for_every_tensor_parallel_rank(tmp_path):
    from types import SimpleNamespace

    from tests.integrations.vllm_engine import FullAttentionSpec, vllm_config
    from tiered_kv.integrations.vllm import KVConnectorRole, TieredKVConnector

    config = vllm_config({"disk": {"url": f"lmdb://{tmp_path}/db"}})
    config.parallel_config.tensor_parallel_size = 2
    mla = type("MLAAttentionSpec", (FullAttentionSpec,), {})(num_kv_heads=1, head_size=576)
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=mla, layer_names=["l0", "l1"])])
    sched = TieredKVConnector(config, KVConnectorRole.SCHEDULER, groups)
    assert (sched.namespace.tp_rank, sched.namespace.tp_size) == (0, 1)  # one copy, whichever rank
    sched.shutdown()
    # a rank that is not the writer reports its saves done without storing the same bytes again
    conn = connector(tmp_path / "r1", namespace(MLA))
    conn.worker.writer = False
    conn.worker.register_kv_caches([tensors(MLA, 3)])
    conn.update_state_after_alloc(request("a"), [list(range(1, 8))], 0)
    run_step(conn, "a", [list(range(1, 8))], 0, len(PROMPT))
    keys = list(conn.scheduler.keys_of("a"))
    assert conn.request_finished(request("a"), [list(range(1, 8))])
    assert conn.worker.get_finished({"a"}) == (["a"], [])
    assert len(keys) == 6 and conn.store.lookup(keys) == 0
    conn.close()


def test_regression_every_load_of_fp8_latents_kept_in_bytes_failed_on_cpu(tmp_path):
    """MLA latents in fp8, kept by the engine in uint8 tensors (vLLM's fp8 cache): their rows
    were copied as fp8, and CPU torch has no ``index_copy_`` for fp8: every block failed to load
    and was recomputed. The rows move as the engine's bytes."""
    mla8 = KVGroup("mla", 3, (12,), "float8_e4m3fn", BS)
    ns = namespace(mla8)
    gen = torch.Generator().manual_seed(3)
    a = [[torch.randint(0, 120, (NB, BS, 12), generator=gen, dtype=torch.uint8) for _ in range(3)]]
    conn, b = _latents_loaded(tmp_path, ns, a)
    assert conn.get_block_ids_with_load_errors() == set()
    for layer in range(3):
        assert torch.equal(b[0][layer][9:15], a[0][layer][1:7])
    conn.close()


# a hybrid of chunked-local attention and recurrent state: a hit ending on a chunk edge keeps no
# token block (vLLM nulls every block before the current chunk), so its load is the state entry alone
CHUNKED = KVGroup("chunked", 2, (2, H, D), "float32", BS, window=2 * BS)
STATE = KVGroup("state", 2, (40,), "float32", 64)


def test_regression_a_hybrid_hit_with_no_token_block_to_load_never_loaded_its_state(tmp_path):
    """The state was scattered only beside a loaded block: the load was reported complete and
    the engine resumed from a state slot holding nothing of the prefix."""
    ns = namespace(CHUNKED, STATE)
    a = [tensors(CHUNKED, 4), tensors(STATE, 5)]
    fill_store(tmp_path, ns, a, [list(range(1, 8)), [9]], [2 * BS, 2 * BS, len(PROMPT) - 4 * BS])
    b = [[torch.zeros_like(t) for t in a[0]], [torch.zeros_like(t) for t in a[1]]]
    conn = connector(tmp_path, ns)
    conn.worker.register_kv_caches(b)
    n, _ = conn.get_num_new_matched_tokens(request("b"), 0)
    assert n == 4 * BS  # a chunk edge: every block before it is the engine's null block
    ids_b = [[-1, -1, -1, -1, 20, 21, 22], [3]]
    conn.update_state_after_alloc(request("b"), ids_b, n)
    run_step(conn, "b", ids_b, 0, len(PROMPT) - n)
    assert conn.get_block_ids_with_load_errors() == set()
    for layer in range(2):
        assert torch.equal(b[1][layer][3], a[1][layer][9])  # the state at the end of block 4
    conn.close()

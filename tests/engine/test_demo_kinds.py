"""`tiered-kv demo restart --model hybrid|mla`: two processes over one LMDB store, the second
loading what the first saved (for the hybrid, the recurrent state with it), with the same outputs."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tiered_kv.cli import main


def demo(workdir, *args: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["demo", "restart", "--dir", str(workdir), "--model-size", "tiny", "--prompt-tokens", "700",
                     "--json", *args])
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("kind", ["hybrid", "mla"])
def test_the_restart_demo_serves_the_model_kind_from_the_store(tmp_path, kind):
    code, report = demo(tmp_path, "--model", kind)
    assert code == 0 and report["outputs_identical"] and report["model"] == kind
    run2 = report["run2"]["prompts"]
    main_prompt = run2["rag-question-1"]
    # 43 blocks reused: from the store, or (MLA) the system prompt from the device, where
    # chat-turn-2 left it (a hybrid keeps no state per device block: all from the store)
    assert main_prompt["matched_tokens"] + main_prompt["device_cached_tokens"] == 688
    assert main_prompt["prefilled_tokens"] == 12
    assert report["ttft_ratio_main_prompt"] > 0  # (a tiny model computes 700 tokens about as fast as it loads them)
    if kind == "hybrid":  # every prompt of run 2 resumed from a state entry saved by run 1
        assert report["run2"]["state_entries_loaded"] == 4
        assert all(p["state_loaded"] for p in run2.values())
        assert main_prompt["device_cached_tokens"] == 0
        assert sum(main_prompt["tier_blocks"].values()) == 43 + 1  # the blocks and the state entry
    else:
        assert report["run2"]["state_entries_loaded"] == 0
        assert sum(main_prompt["tier_blocks"].values()) == main_prompt["matched_tokens"] // 16


def test_the_hybrid_demo_counts_a_corrupt_entry_as_a_miss_with_the_same_outputs(tmp_path):
    code, report = demo(tmp_path, "--model", "hybrid", "--corrupt", "3")
    assert code == 0 and report["outputs_identical"]
    assert len(report["corrupted_blocks"]) == 3 and report["run2"]["misses"].get("corrupt", 0) >= 1


def test_model_dir_is_for_llama_models_only(tmp_path, capsys):
    assert main(["demo", "restart", "--dir", str(tmp_path), "--model", "mla", "--model-dir", str(tmp_path)]) == 2
    assert "Llama" in capsys.readouterr().err

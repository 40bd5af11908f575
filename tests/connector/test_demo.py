"""The restart-and-resume demo, end to end in child processes (tiny model to stay fast)."""

from __future__ import annotations

import json

from tiered_kv.cli import main


def _demo(tmp_path, capsys, *extra: str) -> dict:
    code = main(["demo", "restart", "--dir", str(tmp_path / "demo"), "--json", "--model-size", "tiny",
                 "--prompt-tokens", "1000", *extra])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["outputs_identical"] else 1)
    return report


def test_restart_demo_run_two_loads_the_stored_prefixes_and_outputs_match(tmp_path, capsys):
    report = _demo(tmp_path, capsys)
    assert report["outputs_identical"] is True
    assert report["repeated_prompt_match_fraction"] >= 0.9
    run1, run2 = report["run1"], report["run2"]
    assert run1["matched_tokens"] == 0 and run1["tier_hits_blocks"] == {}
    main_prompt = run2["prompts"]["rag-question-1"]
    reused = main_prompt["matched_tokens"] + main_prompt["device_cached_tokens"]  # system prompt: on device
    assert reused >= 0.9 * main_prompt["full_block_tokens"]
    assert main_prompt["prefilled_tokens"] <= 16
    assert run2["tier_hits_blocks"]["disk"] > 0
    assert run2["prompts"]["chat-turn-2"]["matched_tokens"] > 600, "run 1's answer is part of the history"
    for run in (run1, run2):
        assert set(run) >= {"ttft_s", "prompt_tokens", "matched_tokens", "prefilled_tokens", "tier_hits_blocks"}


def test_corrupted_store_between_runs_recomputes_and_reports_the_misses(tmp_path, capsys):
    report = _demo(tmp_path, capsys, "--corrupt", "6")
    assert len(report["corrupted_blocks"]) == 6
    assert report["outputs_identical"] is True
    assert report["run2"]["misses"].get("corrupt", 0) >= 1

"""Bad input (a file that is not UTF-8, not the JSON or the metrics expected, a directory for a
file, an out-of-range option) and a failing demo phase are one line on stderr with the exit code
the README gives (2: bad usage or configuration), never a traceback and never exit 1, which
means a finding (for the demo: its outputs differ)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import pytest

from storage_backends.lmdb_disk import LmdbBackend
from tiered_kv.cli import main

SECRET = "S3cretPw9"


def run(*args) -> tuple[int, str, str]:
    """``tiered-kv ARGS`` in this process, a SystemExit's code kept as it is (conftest's ``cli``
    takes a message for 2)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def one_error_line(code, out: str, err: str, exit_code: int = 2) -> str:
    assert code == exit_code and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith("tiered-kv: error: ") and "Traceback" not in err
    return err.removeprefix("tiered-kv: error: ").rstrip("\n")


@pytest.fixture
def empty_store(tmp_path) -> str:
    LmdbBackend(tmp_path / "store", capacity="64MiB").close()
    return f"lmdb://{tmp_path / 'store'}"


def finished_child(returncode: int, stderr: str):
    """A stand-in for ``subprocess.run`` whose demo phase ended with ``returncode``."""
    def fake_run(cmd, **kwargs):
        assert "tiered_kv.cli.demo_run" in cmd
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)
    return fake_run


# -- the demo ---------------------------------------------------------------------------------

def test_regression_a_demo_phase_with_a_missing_model_dir_printed_its_traceback(tmp_path):
    message = one_error_line(*run("demo", "restart", "--dir", tmp_path / "d", "--model-dir", tmp_path / "nope",
                                  "--prompt-tokens", "700"))
    assert message == f"model_dir: {tmp_path / 'nope' / 'config.json'} does not exist"


def test_regression_a_crashed_demo_phase_printed_its_traceback_with_the_store_url(tmp_path, monkeypatch):
    url = f"redis://user:{SECRET}@127.0.0.1:1/0?password={SECRET}"
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
              f"ValueError: cannot use {url}\n\n")
    monkeypatch.setattr(subprocess, "run", finished_child(1, stderr))
    message = one_error_line(*run("demo", "restart", "--dir", tmp_path, "--store", url, "--prompt-tokens", "700"))
    assert message.startswith("demo run1 failed (exit 1): ValueError: cannot use redis://user:***@")
    assert message.endswith("(-v shows its output)") and SECRET not in message


def test_regression_a_demo_phase_killed_by_a_signal_raised_a_runtime_error(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", finished_child(-9, ""))
    message = one_error_line(*run("demo", "restart", "--dir", tmp_path, "--store", f"lmdb://{tmp_path / 's'}",
                                  "--prompt-tokens", "700"))
    assert message == "demo run1 was killed by SIGKILL"


def test_regression_a_demo_phase_that_cannot_reach_its_store_is_exit_3(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", finished_child(3, f"WARNING x: slow\nredis://u:{SECRET}@h:1 is down\n"))
    message = one_error_line(*run("demo", "restart", "--dir", tmp_path, "--store", f"redis://u:{SECRET}@h:1",
                                  "--prompt-tokens", "700"), exit_code=3)
    assert message == "redis://u:***@h:1 is down"


@pytest.mark.parametrize("args, says", [
    (["--prompt-tokens", "10"], "--prompt-tokens must be at least 700, got 10"),
    (["--model", "mla", "--model-dir", "."], "--model-dir loads Llama models"),
    (["--corrupt", "-1"], "--corrupt must be 0 or more, got -1"),  # corrupted all blocks but one
])
def test_regression_bad_demo_usage_exited_1_which_means_the_outputs_differ(tmp_path, monkeypatch, args, says):
    def no_demo(opts):
        raise AssertionError("the demo ran")
    monkeypatch.setattr("tiered_kv.cli.demo_run.run_demo", no_demo)
    message = one_error_line(*run("demo", "restart", "--dir", tmp_path, "--prompt-tokens", "700",
                                  "--model-size", "tiny", *args))
    assert says in message


# -- explain and --namespace files ------------------------------------------------------------

def test_regression_a_tokens_file_not_utf8_escaped_as_a_unicode_error(tmp_path, empty_store):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\xff\xfe 1 2 3")
    message = one_error_line(*run("explain", empty_store, "--tokens", tokens))
    assert message.startswith(f"cannot read tokens from {tokens}: not UTF-8 text")


@pytest.mark.parametrize("content", ["[]", "3", '"m"'])
def test_regression_a_namespace_file_not_holding_an_object_escaped_as_an_attribute_error(
        tmp_path, empty_store, content):
    ns = tmp_path / "ns.json"
    ns.write_text(content)
    message = one_error_line(*run("ls", empty_store, "--namespace", ns))
    assert message.startswith(f"namespace file {ns}: namespace fields must be a mapping (a JSON object)")


@pytest.mark.parametrize("args, says", [
    (["--layer-groups", "0"], "--layer-groups must be a positive integer, got 0"),
    (["--min-samples", "-5"], "--min-samples must be a positive integer, got -5"),
])
def test_regression_explain_took_restore_settings_the_config_refuses(empty_store, args, says):
    assert one_error_line(*run("explain", empty_store, "--token-ids", "1,2,3", *args)) == says


# -- stats ------------------------------------------------------------------------------------

GOOD = ('tiered_kv_hits_total{tier="disk"} 5\n'
        'tiered_kv_misses_total{tier="disk",reason="absent"} 2\n'
        'tiered_kv_bytes_total{tier="disk",direction="in"} 4096\n')


def test_regression_a_scrape_sample_without_its_label_was_exit_1_error_reason(tmp_path):
    scrape = tmp_path / "scrape.txt"
    scrape.write_text(GOOD + 'tiered_kv_misses_total{tier="disk"} 3\n'  # no reason
                      'tiered_kv_hits_total 7\n'  # no tier
                      'tiered_kv_bytes_total{tier="disk",direction="sideways"} 1\n'
                      'tiered_kv_events_total{kind="x"} 1\n'  # no event
                      'tiered_kv_hits_total{tier="host"} NaN\n')  # int(NaN): a ValueError
    code, out, err = run("stats", scrape, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["skipped_samples"] == 5 and list(report["tiers"]) == ["disk"] and report["events"] == {}
    disk = report["tiers"]["disk"]
    assert disk["hits"] == 5 and disk["misses"] == {"absent": 2} and disk["in"]["bytes"] == 4096
    code, out, err = run("stats", scrape)
    assert code == 0 and "disk" in out and "skipped 5 samples" in out, err


def test_regression_a_scrape_of_samples_without_their_labels_only_is_one_error_line(tmp_path):
    scrape = tmp_path / "scrape.txt"
    scrape.write_text('tiered_kv_misses_total{tier="disk"} 3\n')
    message = one_error_line(*run("stats", scrape))
    assert message.startswith("no tiered_kv metrics in that text") and "1 samples skipped" in message


def test_regression_a_saved_scrape_not_utf8_escaped_as_a_unicode_error(tmp_path):
    scrape = tmp_path / "scrape.txt"
    scrape.write_bytes(b"\xff\xfe" + GOOD.encode())
    assert "not Prometheus metrics text (not UTF-8" in one_error_line(*run("stats", scrape))


def test_regression_stats_of_a_directory_was_cannot_fetch_no_host_exit_3(tmp_path):
    assert one_error_line(*run("stats", tmp_path)).startswith(f"{tmp_path} is not a file")


@pytest.mark.parametrize("name", ["missing.txt", "scrapes/missing.prom"])
def test_regression_stats_of_a_missing_file_was_cannot_fetch_host_exit_3(tmp_path, name):
    path = tmp_path / name
    code, out, err = run("stats", path)
    assert code == 2 and one_error_line(code, out, err).startswith(f"no such file: {path}")


def test_regression_stats_of_an_env_file_given_by_mistake_printed_its_password(tmp_path):
    env = tmp_path / "tkv.env"
    env.write_text("TIERED_KV_REMOTE_URL=redis://:hunter2-sekrit@cache:6379/0\n")
    message = one_error_line(*run("stats", env))
    assert "not Prometheus metrics text" in message and "hunter2" not in message

"""The store ``tiered-kv demo restart`` leaves behind (made once per session, tiny model) and a
helper that runs the CLI in this process."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiered_kv.cli import main

PROMPT_TOKENS = 700  # the demo's minimum: keeps the session fixture around 10 s


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def cli(*args: str) -> Result:
    """``tiered-kv ARGS`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return Result(code, out.getvalue(), err.getvalue())


@dataclass
class DemoStore:
    workdir: Path
    report: dict  # what `demo restart --json` printed
    run1: dict  # the demo's per-run files (store statistics included)
    run2: dict
    prompts: dict[str, list[int]]  # every prompt run 2 served, by name

    @property
    def path(self) -> Path:
        return self.workdir / "store"

    @property
    def url(self) -> str:
        return f"lmdb://{self.path}"

    def copy(self, dest: Path) -> Path:
        """A private copy of the store to damage or change."""
        shutil.copytree(self.path, dest)
        return dest


def _prompts(workdir: Path, run1: dict) -> dict[str, list[int]]:
    from tiered_kv.cli.demo_run import DemoOptions, _model_config, _tokens, base_prompts

    opts = DemoOptions(workdir, prompt_tokens=PROMPT_TOKENS, model_size="tiny")
    vocab = _model_config(opts).vocab_size
    prompts = base_prompts(opts, vocab)
    chat = prompts["chat-turn-1"] + run1["prompts"]["chat-turn-1"]["output"]  # as run 2 builds it
    prompts["chat-turn-2"] = chat + _tokens(random.Random(opts.seed + 1), 120, vocab)
    return prompts


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory) -> DemoStore:
    workdir = tmp_path_factory.mktemp("demo")
    result = cli("demo", "restart", "--dir", workdir, "--json", "--model-size", "tiny",
                 "--prompt-tokens", PROMPT_TOKENS)
    assert result.code == 0, result.err
    run1 = json.loads((workdir / "run1.json").read_text())
    run2 = json.loads((workdir / "run2.json").read_text())
    return DemoStore(workdir, result.json(), run1, run2, _prompts(workdir, run1))


@pytest.fixture
def demo_copy(demo_store, tmp_path) -> Path:
    return demo_store.copy(tmp_path / "store")

"""Running the radix-cache roles (radix_roles.py) from the tests: each phase is one fresh Python
process importing SGLang (most of a phase's cost), so a test module batches its scenarios as
jobs: one producer process runs every job's producer, then one consumer process every job's
consumer, and each test reads its own job's results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
PAGE_SIZE = 4
PHASE_TIMEOUT_S = 600  # hang guard for a whole process


def job(spec, storage_dir: Path, *, layout: str, interface_v1: bool, tokens: list[int],
        expected: Path, write_policy: str = "write_through", prefetch_policy: str = "wait_complete",
        **more: Any) -> dict[str, Any]:
    """The settings of one scenario's server (see radix_roles.py for the keys)."""
    return {"backend": spec.id, "storage_dir": str(storage_dir), "page_size": PAGE_SIZE,
            "layout": layout, "interface_v1": interface_v1, "tokens": tokens, "expected": str(expected),
            "write_policy": write_policy, "prefetch_policy": prefetch_policy, **more}


def run_phase(phase: str, jobs: list[dict], workdir: Path) -> list[dict]:
    """Run ``radix_roles <phase>`` over ``jobs`` in one new process; one result per job (a job
    that raised has ``error`` with its traceback)."""
    settings = workdir / f"{phase}-{len(list(workdir.glob(f'{phase}-*.json')))}.json"
    settings.write_text(json.dumps({"jobs": jobs}))
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.sglang_real.radix_roles", phase,
                           str(settings)], cwd=REPO, capture_output=True, text=True, timeout=PHASE_TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(lines[-1][len("RESULT "):])
    assert len(results) == len(jobs)
    return results


def ok(result: dict) -> dict:
    """The result of a job that ran to its end (fails the test with the job's traceback)."""
    assert "error" not in result, result["error"]
    return result


def sequence(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * PAGE_SIZE))

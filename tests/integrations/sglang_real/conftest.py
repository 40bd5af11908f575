"""Opt-in: SGLang's own HiCache code on CPU. Needs .venv-sglang (tools/check_sglang.sh); in any
other environment these modules are not even collected. Device<->host KV copies use plain torch
in place of SGLang's CUDA kernels (see cpu_copies.py); nothing else of SGLang is replaced."""

from __future__ import annotations

import importlib.util
import logging

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]

log = logging.getLogger(__name__)


@pytest.fixture(scope="session", autouse=True)
def _cpu_copies():
    if importlib.util.find_spec("sglang") is not None:
        from tests.integrations.sglang_real import cpu_copies

        cpu_copies.install()


def _backend_params():
    from tests.integrations.sglang_real.backends import BACKENDS

    return [pytest.param(spec, id=spec.id) for spec in BACKENDS]


@pytest.fixture(params=_backend_params())
def backend_spec(request):
    """Each L3 backend, built by SGLang's ``dynamic`` factory; tiered-kv's adapter is skipped
    (with the reason) while ``tiered_kv.integrations.sglang`` cannot be imported."""
    from tests.integrations.sglang_real.backends import unavailable_reason

    spec = request.param
    reason = unavailable_reason(spec)
    if reason:
        pytest.skip(reason)
    return spec

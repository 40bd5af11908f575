"""``tiered-kv copy --overwrite`` replaces a destination's block only with one sealed alike: an
encrypted (sealed) block is never replaced by a plain one, nor a plain one by a sealed one; those
are kept and counted (``encrypted_kept`` / ``unencrypted_kept``, in ``--json`` and the text
report), and the destination's engines keep their hits. Plain over plain and sealed over sealed
are replaced as before. Real stores written by engine-side TieredStores (LMDB under tmp_path, a
real Redis), the real CLI."""

from __future__ import annotations

import torch

from tests.cli.conftest import cli
from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.admin.catalog import kind_of
from tiered_kv.admin.opening import open_tier
from tiered_kv.store.codec import BlockCodec

SECRET = "correct horse battery staple"
N = 4


def saved(where, secret: str | None, seed: int, **over) -> list[torch.Tensor]:
    """N blocks saved by an engine's store under ``where`` (sealed with ``secret``); their payloads."""
    with make_store(where, encryption_secret=secret, **over) as store:
        data = payloads(store, N, seed=seed)
        store.save(keys_for(N), data)
        assert store.flush(30)
    return data


def served(where, secret: str | None, **over) -> list[torch.Tensor]:
    """What a replica (with ``secret``) over the store under ``where`` loads: every block a hit."""
    with make_store(where, encryption_secret=secret, **over) as store:
        ok, outs = load(store, keys_for(N))
        assert ok == [True] * N and store.metrics.misses() == 0, dict(store.metrics.tiers)
    return outs


def held_sealed(url: str) -> list[bool]:
    """Whether each block the store at ``url`` holds is sealed."""
    tier = open_tier(url)
    try:
        keys = sorted(k for k in tier.backend.scan() if kind_of(k) == "block")
        return [BlockCodec.read_header(v).sealed for v in tier.backend.get_many(keys)]
    finally:
        tier.close()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_regression_copy_overwrite_from_a_plain_store_stripped_the_destinations_encryption(tmp_path):
    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    saved(plain, None, seed=1)
    theirs = saved(sealed, SECRET, seed=2)
    result = cli("copy", f"lmdb://{plain}/lmdb", f"lmdb://{sealed}/lmdb", "--overwrite", "--json")
    assert result.code == 0, result.out + result.err
    assert held_sealed(f"lmdb://{sealed}/lmdb") == [True] * N
    assert same(served(sealed, SECRET), theirs)  # no `unencrypted` misses: every hit kept
    report = result.json()
    assert (report["copied"], report["encrypted_kept"], report["unencrypted_kept"]) == (0, N, 0), report

    text = cli("copy", f"lmdb://{plain}/lmdb", f"lmdb://{sealed}/lmdb", "--overwrite")
    assert text.code == 0 and f"kept {N} encrypted blocks of the destination" in text.out, text.out


def test_copy_overwrite_from_a_sealed_store_keeps_a_plain_destinations_blocks(tmp_path):
    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    theirs = saved(plain, None, seed=1)
    saved(sealed, SECRET, seed=2)
    result = cli("copy", f"lmdb://{sealed}/lmdb", f"lmdb://{plain}/lmdb", "--overwrite", "--json")
    assert result.code == 0, result.out + result.err
    assert held_sealed(f"lmdb://{plain}/lmdb") == [False] * N
    assert same(served(plain, None), theirs)  # no `no_key` misses a replica without a secret never heals
    report = result.json()
    assert (report["copied"], report["encrypted_kept"], report["unencrypted_kept"]) == (0, 0, N), report
    text = cli("copy", f"lmdb://{sealed}/lmdb", f"lmdb://{plain}/lmdb", "--overwrite", "--no-verify")
    assert text.code == 0 and f"kept {N} unencrypted blocks of the destination" in text.out, text.out


def test_copy_overwrite_still_replaces_plain_by_plain_and_sealed_by_sealed(tmp_path):
    for secret in (None, SECRET):
        src, dst = tmp_path / f"src-{secret is None}", tmp_path / f"dst-{secret is None}"
        wanted = saved(src, secret, seed=1)
        saved(dst, secret, seed=2)
        result = cli("copy", f"lmdb://{src}/lmdb", f"lmdb://{dst}/lmdb", "--overwrite", "--json")
        assert result.code == 0, result.out + result.err
        report = result.json()
        assert (report["copied"], report["encrypted_kept"], report["unencrypted_kept"]) == (N, 0, 0), report
        assert same(served(dst, secret), wanted), secret


def test_copy_overwrite_into_a_sealed_redis_keeps_its_blocks(tmp_path, redis_url):
    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    saved(plain, None, seed=1)
    theirs = saved(sealed, SECRET, seed=2, disk=None, remote_url=redis_url)
    result = cli("copy", f"lmdb://{plain}/lmdb", redis_url, "--overwrite", "--json")
    assert result.code == 0, result.out + result.err
    assert held_sealed(redis_url) == [True] * N
    assert same(served(sealed, SECRET, disk=None, remote_url=redis_url), theirs)
    report = result.json()
    assert (report["copied"], report["encrypted_kept"]) == (0, N), report

"""The ``auto`` codec: raw bodies where compressing or decoding would be the slowest step of the
write-behind or of a restore, byte-shuffled zstd where enough threads keep up with the medium."""

import torch

from tests.store.helpers import keys_for, load, make_store, payloads
from tiered_kv.config import ConfigError, DiskConfig
from tiered_kv.store import codec_choice
from tiered_kv.store.codec import BlockCodec


def test_auto_stores_raw_bodies_when_the_write_behind_threads_compress_slower_than_the_medium_takes_them():
    assert codec_choice.choose("auto", workers=2, cpus=2, rate=0.9, decode=2.4) == "raw"  # a 2-vCPU host
    assert codec_choice.choose("auto", workers=16, cpus=2, rate=0.9, decode=2.4) == "raw", \
        "threads beyond the CPUs do not compress"


def test_regression_a_2_vcpu_host_with_a_fast_cpu_compressed_and_quartered_its_warm_restores(monkeypatch):
    """Two threads compressing 2.2 GB/s each kept up with the write-behind's 4 GB/s, so ``auto``
    compressed, and a warm restore (two threads decoding ~2-2.7 GB/s each) fell from 7-13 GB/s
    raw to under 4: the decode rate decides too."""
    monkeypatch.setattr(codec_choice, "compress_rate", lambda frame_bytes=1 << 20: 2.24)
    monkeypatch.setattr(codec_choice, "decode_rate", lambda frame_bytes=1 << 20: 2.69, raising=False)
    assert codec_choice.choose("auto", workers=2, cpus=2) == "raw"
    assert codec_choice.choose("auto", workers=8, cpus=16) == "zstd+shuffle", "eight threads decode 21 GB/s"


def test_auto_compresses_when_enough_threads_keep_up_with_the_medium():
    assert codec_choice.choose("auto", workers=8, cpus=32, rate=0.9, decode=2.4) == "zstd+shuffle"
    assert codec_choice.choose("auto", workers=8, cpus=32, rate=0.9, decode=1.0) == "raw", "decoding is the slow step"


def test_an_explicit_codec_is_kept_whatever_the_machine():
    for codec in ("raw", "zstd", "zstd+shuffle"):
        assert codec_choice.choose(codec, workers=64, cpus=64, rate=10.0, decode=10.0) == codec
        assert codec_choice.choose(codec, workers=1, cpus=1, rate=0.01, decode=0.01) == codec


def test_the_measured_rates_are_positive_and_taken_once():
    first, decoding = codec_choice.compress_rate(), codec_choice.decode_rate()
    assert first > 0 and codec_choice.compress_rate() == first
    assert decoding > 0 and codec_choice.decode_rate() == decoding


def test_the_rate_is_taken_once_per_frame_size():
    small, large = codec_choice.compress_rate(16 << 10), codec_choice.compress_rate(1 << 20)
    assert small > 0 and codec_choice.compress_rate(16 << 10) == small
    assert codec_choice.compress_rate(4 << 20) == large, "frames beyond the sample are measured as the sample"
    assert {16 << 10, 1 << 20} <= set(codec_choice._rates)


def test_regression_auto_was_measured_on_1_mib_whatever_frames_the_tier_compresses(tmp_path, monkeypatch):
    """Each frame has fixed work, so small frames compress slower: a store of small blocks (or of
    many layer groups) was told the 1 MiB rate, and could compress where it cannot keep up."""
    asked: list[int] = []
    monkeypatch.setattr(codec_choice, "compress_rate", lambda frame_bytes=1 << 20: asked.append(frame_bytes) or 0.5)
    monkeypatch.setattr(codec_choice, "decode_rate", lambda frame_bytes=1 << 20: asked.append(frame_bytes) or 2.0)
    with make_store(tmp_path, disk={"codec": "auto"}) as store:  # 16 KiB blocks, one frame each
        assert store.tier("disk").segments is None
    assert asked == [16 << 10, 16 << 10]


def test_the_sample_the_rate_is_measured_on_compresses_like_kv_data():
    sample = codec_choice.sample_block()
    blob = BlockCodec("zstd+shuffle").encode(sample, dtype="bfloat16", shape=(sample.size,),
                                             namespace=bytes(16), key=bytes(16))
    assert 1.2 < sample.nbytes / len(blob) < 2.0, "a sample that compresses unlike KV would mislead the choice"


def test_an_unknown_codec_is_a_config_error():
    try:
        DiskConfig(codec="lz4")
    except ConfigError as exc:
        assert "auto" in str(exc)
    else:
        raise AssertionError("lz4 accepted")


def test_a_store_reports_the_codec_auto_chose_and_reads_blocks_another_codec_wrote(tmp_path):
    keys = keys_for(3)
    with make_store(tmp_path, disk={"codec": "zstd+shuffle"}) as store:
        data = payloads(store, 3)
        store.save(keys, data)
        store.flush()
        assert store.stats()["codecs"] == {"disk": "zstd+shuffle"}
    with make_store(tmp_path, disk={"codec": "auto"}, host="64KiB") as store:
        assert store.stats()["codecs"]["disk"] in ("raw", "zstd+shuffle")
        ok, outs = load(store, keys)
        assert all(ok) and all(torch.equal(a, b) for a, b in zip(data, outs))


def test_a_container_cpu_quota_bounds_the_threads_auto_counts_on(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("200000 100000\n")  # two CPUs' time
    assert codec_choice.usable_cpus(str(quota)) <= 2
    quota.write_text("max 100000\n")
    assert codec_choice.usable_cpus(str(quota)) >= 1
    assert codec_choice.usable_cpus(str(tmp_path / "absent")) >= 1

"""bench_tiers' targets: which store figure is held against which limit and the minimum ratio
(``TARGETS``, pass/fail), the context rows that are not targets (``EXTRA_TARGETS``), the derived
bounds (the slower of the codec on 2 threads and the medium moving the compressed bytes), and the
ratios computed from one run's figures."""

from __future__ import annotations

from .common import GB, median
from .data import SIZES
from .figures import Figures

TARGETS = [
    # (name, store figure, bound figure, minimum ratio, what it means)
    ("host_save_vs_memcpy", "store.host_save", "limits.memcpy", 0.7,
     "store.save into host slots vs memcpy into pre-touched memory (best of 1 and 2 threads)"),
    ("host_load_vs_memcpy", "store.host_load", "limits.memcpy", 0.7,
     "load_into from host hits vs memcpy into pre-touched memory (best of 1 and 2 threads)"),
    ("lmdb_write_behind_vs_compress", "store.lmdb_write_behind", "limits.codec_encode_2t", 0.7,
     "save -> every block committed to LMDB vs BlockCodec encode on 2 threads"),
    ("lmdb_restore_warm_vs_decompress", "store.lmdb_restore_warm", "limits.codec_decode_2t", 0.7,
     "load_into from LMDB, page cache warm vs BlockCodec decode on 2 threads"),
    ("lmdb_restore_cold_vs_naive_cold", "store.lmdb_restore_cold", "limits.naive_load_cold", 1.0,
     "load_into from LMDB, page cache dropped vs torch.load + copy per file, cold"),
    ("redis_write_behind_vs_redis_py_set", "store.redis_write_behind", "limits.redis_py_set", 0.7,
     "save -> flush() with a Redis tier vs redis-py SET of the raw payloads one at a time"),
    ("redis_restore_vs_redis_py_get", "store.redis_restore", "limits.redis_py_get", 0.7,
     "load_into from Redis vs redis-py GET of the raw payloads one at a time"),
    ("save_vs_naive_save", "store.save_visible", "limits.naive_save", 3.0,
     "what the engine waits for: store.save() with an LMDB tier attached (write-behind queued) "
     "vs torch.save per block (no fsync)"),
]
# Context, not targets: the durable save against the synced naive save, and which part of the
# machine bounds a tier: the slower of the codec on 2 threads and the medium moving the compressed
# bytes (all payload GB/s, same run).
EXTRA_TARGETS = [
    ("durable_save_vs_naive_save_fsync", "store.lmdb_durable_save", "limits.naive_save_fsync", 3.0,
     "durable save: save -> flush() (LMDB synced) vs torch.save + fsync per block"),
    ("lmdb_write_behind_vs_durable_bound", "store.lmdb_durable_save", "limits.bound_durable_write", 0.7,
     "vs min(BlockCodec encode 2t, raw file write+fsync x compression ratio)"),
    ("lmdb_restore_cold_vs_cold_read_bound", "store.lmdb_restore_cold", "limits.bound_cold_read", 0.7,
     "vs min(BlockCodec decode 2t, raw file cold read x compression ratio)"),
    ("redis_write_behind_vs_encoded_set_bound", "store.redis_write_behind", "limits.bound_redis_write", 0.7,
     "vs min(BlockCodec encode 2t, redis-py SET of the encoded blobs)"),
    ("redis_restore_vs_encoded_get_bound", "store.redis_restore", "limits.bound_redis_read", 0.7,
     "vs min(BlockCodec decode 2t, redis-py GET of the encoded blobs)"),
]
DERIVED = {  # name -> (codec figure, medium figure, scale the medium by the compression ratio)
    "limits.bound_durable_write": ("limits.codec_encode_2t", "limits.file_write_fsync", True),
    "limits.bound_cold_read": ("limits.codec_decode_2t", "limits.file_read_cold", True),
    "limits.bound_redis_write": ("limits.codec_encode_2t", "limits.redis_py_set_encoded", False),
    "limits.bound_redis_read": ("limits.codec_decode_2t", "limits.redis_py_get_encoded", False),
}


def derive(fig: Figures, compression: dict[str, dict]) -> None:
    """The DERIVED bounds, repeat by repeat: the slower of the codec and the medium."""
    for size in SIZES:
        ratio = compression.get(size, {}).get("store_codec_ratio")
        for name, (codec, medium, scaled) in DERIVED.items():
            a, b = fig.gbps_runs(size, codec), fig.gbps_runs(size, medium)
            if not a or not b or (scaled and not ratio):
                continue
            nbytes, nblocks = fig.work[(size, codec)]
            for x, y in zip(a, b):
                bound = min(x, y * ratio if scaled else y)
                fig.add(size, name, nbytes / (bound * GB), nbytes, nblocks,
                        what=f"min({codec.split('.')[1]}, {medium.split('.')[1]}"
                             f"{' x compression ratio' if scaled else ''})")


def ratios(fig: Figures) -> list[dict]:
    out = []
    for size in SIZES:
        for extra, (name, num, den, target, what) in [(False, t) for t in TARGETS] + \
                [(True, t) for t in EXTRA_TARGETS]:
            a, b = fig.get(size, num), fig.get(size, den)
            entry: dict = {"size": size, "name": name, "target": target, "store": num, "bound": den,
                           "what": what}
            if extra:
                entry["extra"] = True
            if a and b and "gbps" in a and "gbps" in b:
                ratio = a["gbps"] / b["gbps"]
                ra, rb = fig.gbps_runs(size, num), fig.gbps_runs(size, den)
                paired = [x / y for x, y in zip(ra, rb)]
                entry.update({"store_gbps": a["gbps"], "bound_gbps": b["gbps"],
                              "ratio": round(ratio, 3),
                              "ratio_paired_median": round(median(paired), 3) if paired else None,
                              "pass": bool(ratio >= target and "error_in_some_runs" not in a)})
                if den == "limits.memcpy":  # the best-of bound: say how it compares to each
                    for t in ("1t", "2t"):
                        f = fig.get(size, f"limits.memcpy_{t}")
                        if f and "gbps" in f:
                            entry[f"ratio_vs_memcpy_{t}"] = round(a["gbps"] / f["gbps"], 3)
            else:
                entry.update({"ratio": None, "pass": False,
                              "error": (a or {}).get("error") or (b or {}).get("error")
                              or "not measured"})
            out.append(entry)
    return out

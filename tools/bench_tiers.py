#!/usr/bin/env python
"""Benchmark every tier of TieredStore against this machine's limits, measured in the same run.

    python tools/bench_tiers.py [--json] [--blocks N] [--small-blocks M] [--repeats R]
                                [--redis-url URL] [--dir DIR] [--quick]

Two block sizes, both bf16, KV-like data (per-channel means and scales, a few outlier channels),
generated once and reused everywhere:

- ``2MiB``: Llama-8B-like, ``[32 layers, K/V, 16 tokens, 8 KV heads, 128]``;
- ``64KiB``: one layer of the same, ``[1, 2, 16, 8, 128]`` (the 2 MiB blocks cut per layer).

For each, in every repeat and close together in time (the machine is shared and noisy, so only
ratios taken in one run mean anything):

- limits: memcpy into pre-touched memory on 1 and 2 threads (plain memcpy via numpy; plus, as a
  diagnostic, torch ``copy_`` with torch's own OpenMP threads); BlockCodec encode / decode on 1
  and 2 threads with the codec the store writes (the default ``auto`` resolved for this machine
  as the store resolves it: ``raw`` or ``zstd+shuffle``; both recorded in the report), and plain
  zstd-1; one raw file written sequentially (``file_write``: in the page cache, loadable by
  another process) then fsync'd (``file_write_fsync``: the total), read warm and cold; redis-py
  SET / GET one at a time (and ``redis-benchmark`` when installed: SETs of one key, each
  replacing the last value, and of a new key each, every value kept as a store's puts are:
  ``set_new_keys``); the naive baseline, one
  ``torch.save`` file per block (copied out first), with and without fsync, ``torch.load`` + copy
  warm and cold (torch held to one intra-op thread there, so the baseline measures files and not
  OpenMP stalls);
- the store: host save / load, LMDB write-behind (save of every block until it is committed to
  LMDB, and until ``flush()`` made it durable) and the engine-visible part of it (until ``save()``
  returned), LMDB restore warm and cold (a fresh store on the same directory with a host tier of
  two load batches, so every block comes from disk; ``load_into`` one batch at a time, decoded
  straight into the caller's CPU tensors), Redis write-behind and restore (remote tier only;
  and again into another replica's store with an empty disk tier above Redis, whose copies up
  are write-behind: a context row against the restore from Redis alone);
- ratios against the targets (``tools/bench/targets.py``), each with a pass flag, all taken
  against limits measured in the same run:

      host save / load           >= 0.7  x memcpy (best of 1 and 2 threads)
      LMDB write-behind          >= 0.55 x raw file write (page cache)
      LMDB durable save          >= 0.87 x raw file write + fsync
      LMDB restore, warm         >= 0.91 x raw file read, warm
      LMDB restore, cold         >= 1.2  x raw file read, cold
      Redis write-behind         >= 0.8  x redis-py SET, one at a time
      Redis restore              >= 0.8  x redis-py GET, one at a time
      host save / load, 64 KiB   >= 0.8  x the same at 2 MiB (GB/s; per-block cost)
      compression ratio          >= 1.40 where the codec compresses (n/a for raw)

  (the disk ones: 1.2 x, or for warm reads 1 x, the best peer's ratio to a raw single file in a
  side-by-side run), plus context rows that are not targets: the naive baseline, and which of
  the codec and the medium bounds each tier.

GB/s are 1e9 bytes of uncompressed payload per second; figures are medians over ``--repeats``.
Temporary files and the redis-server this script starts are removed at exit. The code is in
``tools/bench/`` (``tiers_main`` drives it); this script only launches it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):  # a script: the project from this checkout, and tools/bench
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.tiers_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

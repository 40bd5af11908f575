#!/usr/bin/env python
"""Redis Cluster put / get GB/s through the store's remote tier, beside plain redis-py on the same
cluster in the same run, with clusters of 1 and 3 masters started for the run.

    python tools/bench_cluster.py [--json] [--quick] [--masters 1,3] [--replicas R] [--mib M]
                                  [--kinds llama8b-2MiB,demo-128KiB] [--repeats N] [--workers W]
                                  [--io-threads T] [--codec C] [--no-encrypt] [--dir DIR]

Blocks: ``llama8b-2MiB`` (Llama-3-8B, 16 tokens, bf16) and ``demo-128KiB`` (the demo model's
block, float32), drawn like real KV and encoded as the remote tier stores them (its codec,
``auto`` resolved for the store's workers, and its layer-group frames); the codec ratio is
reported, and the ratio zstd+shuffle would give beside it.

Per cluster size, repeat and kind, close together in time, in alternating order:

- ours: the remote tier's backend (``storage_backends``, opened for the ``redis+cluster://`` URL
  as the store opens it), ``put_many`` per write-behind job (16 MiB) and ``visit_many`` per load
  job, on the store's number of transfer threads; the backend pipelines them as it does in the
  store (~4 MiB of values per pipeline);
- raw: ``redis.cluster.RedisCluster``, one pipeline of SETs / GETs of the same names and bytes
  per job, on as many threads.

- ours, sealed (``--encrypt``, the default): ours again with the blocks sealed as the store seals
  them with ``encryption_secret`` set (AES-GCM under one tenant's key, frame by frame; sealed
  before the timing: the stored bytes grow by the per-frame overhead, reported per block).

With ``--encrypt`` the client's cost of sealing and opening is measured too, before the clusters
start: the remote tier's own ``put_blobs`` (encode, then seal) and ``read_into`` (open, then
decode) over an in-memory backend, on 1 thread and on the store's transfer threads, beside the
same without a secret; sealed / plain GB/s is the cost (``tools/bench/cluster_crypto.py``).

Reported (medians over the repeats): payload and wire GB/s, ours / raw (paired per repeat), the
stored bytes each master holds (their max / mean) and its ``used_memory`` growth per stored
byte, client CPU s per GB, and each master's command-thread CPU s per GB with its inverse, the
node's ceiling: the GB/s one Redis node carries with a core to itself (what a busy machine cannot
hide). ``model_inputs`` are the figures ``tools/scale_model.py`` reads (``docs/scale.md``).

Clusters get their own ports and temporary directories; every server is stopped on any exit
(and dies with this process if it is killed). The code is in ``tools/bench/cluster_*.py``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):  # a script: the project from this checkout, and tools/bench
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.cluster_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

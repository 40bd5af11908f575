#!/usr/bin/env python
"""The GPU side of the data path against this machine's limits, measured in the same run.

    python tools/bench_cuda.py [--blocks N] [--repeats R] [--workers W] [--json FILE]
                               [--label NAME] [--tree DIR]

Needs a CUDA device (prints a line and exits 0 without one). Limits: one copy host->device and
device->host of a step's bytes from pinned and from pageable memory, the same one 2 MiB block
per copy, and a device->device copy. Ours: the Triton gather/scatter (and torch's) between the
reference engine's pool and canonical blocks; the connector worker's save into pinned host slots
(side stream, until committed), its load of host hits into device blocks, its restore from the
LMDB tier into device blocks in a fresh store; the store's ``save`` / ``load_into`` with device
tensors; ratios of each against the limit it is bounded by. ``--tree DIR`` imports tiered_kv from
another checkout (to put two versions side by side in one session). The code is in
``tools/bench/cuda.py``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # the project from another checkout (before/after in one session)
    i = sys.argv.index("--tree")
    ROOT = Path(sys.argv[i + 1]).resolve()
    del sys.argv[i : i + 2]
for _p in (str(Path(__file__).resolve().parent), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.cuda import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

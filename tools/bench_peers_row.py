"""Our row of the shared side-by-side harness (``../shared/peers/bench_tieredkv.py``) in a
configuration of our choosing: that script always builds ``lmdb://DIR`` with the codec it is
given (``run.sh`` gives none: zstd+shuffle), so the default configuration and medium options such
as ``direct_io`` get their rows here, with the harness's own phases, data and checks.

    python tools/bench_peers_row.py --out F.json --scratch DIR [--codec auto]
        [--disk-options "?direct_io=true"] [--repeats 5] [--blocks 512] [--peers ../shared/peers]

Run it right after ``run.sh`` on the same quiet machine, and report its figures beside that
run's table (the machine's pace moves from one hour to the next)."""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=str(ROOT.parent / "shared" / "peers"), help="the shared harness")
    parser.add_argument("--disk-options", default="", help="appended to lmdb://DIR, e.g. ?direct_io=true")
    parser.add_argument("--codec", default="auto", help="the disk codec (default: ours, auto)")
    args, rest = parser.parse_known_args()
    sys.path[:0] = [args.peers, str(ROOT)]
    import bench_tieredkv  # the harness's script (its directory holds its ``common``)

    plain = bench_tieredkv.make_store

    def make_store(total, host_blocks, disk=None, remote=None, codec="auto"):
        cfg = plain(total, host_blocks, disk=disk, remote=remote, codec=codec)
        if disk and args.disk_options:
            cfg["disk"]["url"] += args.disk_options
        return cfg

    bench_tieredkv.make_store = make_store
    sys.argv = [sys.argv[0], "--codec", args.codec, *rest]
    bench_tieredkv.main()
    if "--out" in rest:
        print(f"wrote {os.path.abspath(rest[rest.index('--out') + 1])}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Cost-aware restore on the reference engine: is a stored prefix worth loading?

    python tools/bench_restore.py [--json] [--lengths 2048,8192] [--repeats R]
                                  [--throttle-mbps 20] [--dir DIR]

Two scenarios, each in fresh processes (bench_e2e's demo model and engine; host tier empty at
every start): a *slow remote* -- a real redis-server behind a TCP proxy that paces both
directions to ``--throttle-mbps`` MB/s (a shared cache across a thin link), no disk tier -- and
a *fast disk* -- LMDB with the page cache warm. Per scenario and prompt length: TTFT of
*recompute* (an empty store), of warm restarts under ``restore_policy = "always"`` (load every
stored block) and under ``"cost"`` (load the prefix that minimizes predicted TTFT), alternating,
one ``always`` first so the store has observed a restore of the tier (``restore_min_samples`` 1:
a fresh benchmark store). The estimates persist in the store between the processes, as they do
across an engine's restarts. Reported: medians, tokens matched, blocks skipped as
``slower_than_recompute``, cost / best-of(always, recompute), outputs identical.

A benchmark, not a test: the figures depend on the machine. Run it on a quiet machine.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.common import MiB  # noqa: E402
from bench.redis_server import OwnRedis  # noqa: E402
from bench.restore_run import child, scenario  # noqa: E402
from bench.throttle_proxy import ThrottleProxy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throttle-mbps", type=float, default=20.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(child(json.loads(args.child))))
        return
    started = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    max_position = max(lengths) + 256
    scratch = tempfile.mkdtemp(prefix="bench-restore-", dir=args.dir)
    redis = OwnRedis(scratch, 4096 * MiB)
    proxy = ThrottleProxy(("127.0.0.1", redis.port), args.throttle_mbps * 1e6)
    common = {"workers": 2, "restore_min_samples": 1}
    slow = {**common, "remote": {"url": proxy.url, "timeout": "30s", "retries": 0}}
    fast = {**common, "disk": {"url": "lmdb://{DIR}/db", "capacity": "4GiB"}}
    rows = []
    try:
        for length in lengths:
            redis_flush(redis)
            rows.append(scenario("slow_remote", slow, length, args.repeats, max_position, scratch))
            rows.append(scenario("fast_disk", fast, length, args.repeats, max_position, scratch))
    finally:
        proxy.close()
        redis.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"bench": "cost-aware restore, reference engine (demo model)", "throttle_mbps": args.throttle_mbps,
              "repeats": args.repeats, "rows": rows, "elapsed_s": round(time.perf_counter() - started, 1)}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'scenario':<12} {'tokens':>6} {'recompute s':>11} {'always s':>9} {'cost s':>7} "
          f"{'cost matched':>12} {'cost/best':>9} same")
    for r in rows:
        print(f"{r['scenario']:<12} {r['prompt_tokens']:>6} {r['recompute']['ttft_s']:>11.3f} "
              f"{r['always']['ttft_s']:>9.3f} {r['cost']['ttft_s']:>7.3f} {r['cost']['matched_tokens']:>12} "
              f"{r['cost_over_best_of_both']:>9.3f} {'yes' if r['outputs_identical'] else 'NO'}")


def redis_flush(redis: OwnRedis) -> None:
    import redis as redis_py

    redis_py.Redis.from_url(redis.url).flushall()


if __name__ == "__main__":
    main()

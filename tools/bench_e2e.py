"""End-to-end benchmark on the reference engine: cold vs warm-restart TTFT, and decode overhead.

    python tools/bench_e2e.py [--json] [--lengths 512,2048,8192] [--repeats R] [--decode-steps N]
                              [--load-modes whole,layerwise] [--continue-tokens N] [--dir DIR] [--quick]

Everything runs on the demo model (``ModelConfig.demo()``, fp32) with one engine configuration:
block 16, ``max_num_batched_tokens`` 8192 (a prompt of up to 8192 tokens is prefilled in one
step, no chunking), ``max_position`` = longest prompt + 256, a KV pool sized for the longest
prompt, a connector with sync loads (``load_async=False``) over a host tier and an LMDB disk
tier (codec ``auto``, the default, ``write_through``).

1. TTFT, per prompt length. A *cold* child process (empty LMDB store) prefills the prompt; the
   connector saves every full block; the store is flushed and closed. Then, ``--repeats`` times,
   a *warm-restart* child process (new engine, new connector on the same LMDB path, so the host
   tier is empty and every block comes from LMDB) serves the same prompt twice with a fresh engine
   and connector each time: once with the LMDB data file in the page cache, once after
   ``fsync`` + ``posix_fadvise(DONTNEED)`` dropped its pages (residency checked with mincore).
   Each warm restart runs with whole-block loads (every layer of every block before the forward)
   and with layer-wise loads (``wait_for_layer_load`` waits for one layer group), ``--load-modes``;
   every (variant, mode) pair alternates its order per repeat; ``layerwise_over_whole`` is the
   ratio of their medians. A warm restart restores in a fraction of a millisecond per block and
   then computes one token: little to overlap. So each variant is also run as a *continuation*
   (``warm+256``, ``dropped+256``: the stored prompt followed by ``--continue-tokens`` new
   tokens, a chat's next turn; the connector saves nothing then, so every run finds the same
   store): the restore of the prefix beside the compute of the new tokens, where layer-wise
   loads can overlap them. The connector's ``restore_policy`` is ``always`` (every stored block
   loaded: tools/bench_restore.py measures the cost policy). Reported: TTFT medians and every run, matched /
   prefilled tokens, blocks per serving tier, where the time went (lookup, lease, LMDB read +
   decode in the transfer pool, scatter, forward, save gather), the warm/cold ratio (target
   <= 0.2 from 4096 tokens on) and whether the greedy outputs equal the cold run's.
2. Decode-step time, connector off vs saving: one child process builds two identical engines
   (same seeded weights and config), one without a connector and one with the LMDB write-through
   connector, warms both up, then runs a batch (default 4 requests x 512-token prompts) for N
   decode steps on each, alternating off/on order per repeat (ABBA), new prompts per repeat (the
   same for both engines), and the write-behind drained between runs so no run pays for another.
   Per-step wall time of ``engine.step()`` is taken only for steps where every request decodes.
   Reported: median per-step time per mode, overhead % (median of the per-pair ratios; target
   <= 5%), mean and p90 too, and steps that complete a block (and save it) apart from the rest.
3. Machine, torch, model size, block bytes and stored (compressed) block bytes.

A benchmark, not a test: the figures depend on the machine. Compare ratios taken in one run.
The code is in ``tools/bench/`` (``e2e_main`` drives it); this script only launches it, and is
what the parent runs as each child (``--child``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tools")):  # a script: the project from this checkout, and tools/bench
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.e2e_main import main  # noqa: E402

if __name__ == "__main__":
    main()

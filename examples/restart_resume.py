"""Restart-and-resume demo: the same as ``tiered-kv demo restart`` (takes the same options).

Run 1 (a child process) serves prompts sharing long prefixes and saves their KV blocks to an
LMDB store; run 2 (a new process, same store) serves them again plus a follow-up chat turn,
loading every stored full block instead of prefilling it.
"""

import sys

from tiered_kv.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", "restart", *sys.argv[1:]]))

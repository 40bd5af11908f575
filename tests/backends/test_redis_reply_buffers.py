"""A Redis reply is a new bytes object of a block's size. In a fresh process glibc mapped each one
afresh (and faulted its pages in as the reply was copied into it); a process with a Redis tier
takes them from its heap, as glibc itself does once a large buffer has been freed. An operator's
own malloc setting wins. Each scenario runs in a fresh child process (the setting is per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.backends.helpers import REPO

CHILD = """
import ctypes

from storage_backends.registry import open_backend


def where(buf) -> str:
    address = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
    for line in open("/proc/self/maps"):
        parts = line.split()
        low, high = (int(x, 16) for x in parts[0].split("-"))
        if low <= address < high:
            return parts[5] if len(parts) > 5 else "mapped"
    return "?"


tier = open_backend("redis://127.0.0.1:1/0")  # (no connection is made here)
print(where(bytearray(3 << 20)))
tier.close()
"""


def _where_a_block_sized_buffer_lands(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_regression_every_redis_reply_of_a_fresh_process_was_a_fresh_mapping_faulted_in():
    assert _where_a_block_sized_buffer_lands() == "[heap]"


def test_an_operators_own_malloc_threshold_is_left_as_it_is():
    assert _where_a_block_sized_buffer_lands(MALLOC_MMAP_THRESHOLD_=str(128 << 10)) == "mapped"

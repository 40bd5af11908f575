"""A Redis Cluster tier whose user's ACL allows only the tier's prefix (real cluster): the loss
watch's markers (one per master, hash-tagged, outside the prefix) are refused; the watch says once
which key pattern to allow, and once every node allows it a master's flush is heard as lost."""

from __future__ import annotations

import logging
import re

import storage_backends.redis_epoch as epoch
from storage_backends.registry import open_backend
from tests.backends.helpers import until


def allow_everywhere(cluster, *patterns: str) -> None:
    """A user ``tier`` that may use only the keys of ``patterns``, on every node (ACLs are per node)."""
    for node in cluster.nodes:
        admin = node.client()
        try:
            admin.execute_command("ACL", "SETUSER", "tier", "reset", "on", ">pw", *patterns, "+@all")
        finally:
            admin.close()


def test_a_cluster_user_limited_to_the_prefix_is_told_the_marker_pattern_which_once_allowed_hears_a_flush(
        redis_cluster, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=epoch.__name__)
    monkeypatch.setattr(epoch, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(epoch, "DENIED_EVERY_S", 0.01)  # (looks as often as allowed ones here)
    allow_everywhere(redis_cluster, "~tkv:*")
    b = open_backend(redis_cluster.url.replace("redis+cluster://", "redis+cluster://tier:pw@"))
    heard: list[str] = []
    try:
        b.listen(lambda change, keys: heard.append(change))
        until(lambda: b.epoch.looks >= 5, "the watch never looked")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == epoch.__name__]
        assert len(warnings) == 1  # once, however many looks were refused
        pattern = re.search(r"~\S+", warnings[0]).group()
        assert pattern == "~tkv-epoch:{*}tkv:"
        allow_everywhere(redis_cluster, "~tkv:*", pattern)
        until(lambda: not b.epoch.denied, "the allowed markers were never looked at again")
        looked = b.epoch.looks
        until(lambda: b.epoch.looks >= looked + 2, "the watch stopped looking")  # (every marker was seen)
        assert "lost" not in heard
        master = redis_cluster.masters()[0].client()
        try:
            master.flushall()  # one master's keys: its marker goes too
        finally:
            master.close()
        until(lambda: "lost" in heard, "the flush was never heard")
    finally:
        b.close()
        allow_everywhere(redis_cluster, "~*")  # (the module's cluster is shared: the user may use anything)

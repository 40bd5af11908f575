"""What the Redis tier's loss watch (:mod:`storage_backends.redis_epoch`) says when the server
refuses its marker (the look's ``SET NX`` + ``GET``): once at WARNING when a refusal begins (or
changes), once at INFO when a look is answered again, at DEBUG for every look refused between.

- The ACL refuses the marker's key (``NOPERM`` "... access one of the keys ..."): allow the key
  pattern of the marker (``~tkv-epoch:tkv:``); the watch looks only every ``DENIED_EVERY_S``.
- The ACL refuses a command (``NOPERM`` "... run the 'set' command"): allow that command
  (``+set``); the key pattern would not help (it was what the watch used to advise). Looks are
  as rare.
- The server takes no writes now: a replica (``READONLY``), or a Redis that cannot persist
  (``MISCONF``, a failed RDB snapshot with ``stop-writes-on-bgsave-error``). The loss watch is
  off until it is writable (it used to say so at DEBUG only, at every look); looks go on at the
  usual interval, since a failover or the next good snapshot ends it."""

from __future__ import annotations

import logging
import re

from redis.exceptions import NoPermissionError, ReadOnlyError, ResponseError

_COMMAND = re.compile(r"run the '([^']+)' command")  # (Redis 6 adds "or its subcommand")
_MISCONF = re.compile(r"\bMISCONF\b")  # (redis-py maps no class to it; a pipeline prefixes the command)
ACL_KINDS = ("key", "acl")  # + "command:NAME": refusals of the ACL, after which looks are rare


def refusal_of(exc: BaseException) -> str | None:
    """The kind of refusal ``exc`` is (``key``, ``command:NAME``, ``acl`` (NOPERM saying neither),
    ``readonly``, ``misconf``), or None for another failure (the server away, the tier closed)."""
    text = str(exc)
    if isinstance(exc, NoPermissionError):
        command = _COMMAND.search(text)
        if command:
            return "command:" + command.group(1).lower()
        return "key" if "key" in text.lower() else "acl"
    if isinstance(exc, ReadOnlyError):
        return "readonly"
    if isinstance(exc, ResponseError) and _MISCONF.search(text):
        return "misconf"
    return None


class MarkerRefusals:
    """The refusal the watch of one tier said last, told to ``log`` (the watch's logger)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.kind: str | None = None  # the refusal under way (see refusal_of), None: the last look was answered

    @property
    def denied(self) -> bool:
        """Whether the ACL refuses the marker (looks are rare then)."""
        return self.kind is not None and (self.kind in ACL_KINDS or self.kind.startswith("command:"))

    def refused(self, exc: BaseException, url: str, pattern: str, every_s: float) -> bool:
        """Say a look's failure ``exc`` if it is a refusal of the marker (``pattern``: the ACL
        key pattern to allow; ``every_s``: the seconds between looks while the ACL refuses);
        False when it is another failure, left to the caller."""
        kind = refusal_of(exc)
        if kind is None:
            return False
        if kind == self.kind:
            self.log.debug("redis at %s refuses the epoch marker again: %s", url, exc)
            return True
        self.kind = kind
        lost = "a flush or a restart empty is not announced lost"
        if kind == "key":
            self.log.warning("redis at %s refuses this user the epoch marker (NOPERM): %s; allow the key pattern "
                             "%s in the user's ACL (looked at again every %.0f s)", url, lost, pattern, every_s)
        elif kind.startswith("command:"):
            command = kind.partition(":")[2]
            self.log.warning("redis at %s refuses this user the %s command on the epoch marker (NOPERM): %s; allow "
                             "the command in the user's ACL (+%s; looked at again every %.0f s)", url,
                             command.upper(), lost, command, every_s)
        elif kind == "acl":
            self.log.warning("redis at %s refuses this user the epoch marker (NOPERM: %s): %s; allow the key "
                             "pattern %s and the SET and GET commands in the user's ACL (looked at again every "
                             "%.0f s)", url, exc, lost, pattern, every_s)
        else:
            why = "is a read-only replica (READONLY)" if kind == "readonly" else \
                "refuses writes, unable to persist to disk (MISCONF)"
            self.log.warning("redis at %s %s: the epoch marker cannot be set, so the loss watch is off until it "
                             "is writable (%s meanwhile)", url, why, lost)
        return True

    def answered(self, url: str) -> None:
        """A look was answered: a refusal said before is over."""
        if self.kind is None:
            return
        if self.denied:
            self.log.info("redis at %s allows the epoch marker again: losses are announced", url)
        else:
            self.log.info("redis at %s is writable again: the loss watch is on, losses are announced", url)
        self.kind = None

"""Arguments shared by the store commands and opening the store they name."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import contextmanager

from tiered_kv.admin.opening import Tier, open_config, open_destination, open_tier
from tiered_kv.errors import ConfigError
from tiered_kv.settings.tiers import MAX_TIMEOUT
from tiered_kv.units import parse_duration, parse_size


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", metavar="STORE",
                   help="store URL (lmdb:///dir, file:///dir, redis://host:port/0) or a store directory")
    p.add_argument("--config", metavar="FILE", help="TOML config: its lower tiers instead of STORE")
    p.add_argument("--tier", metavar="NAME", help="with --config: only the tier of this name "
                   "(disk, remote or a [[tiers]] name)")
    add_common(p)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=timeout_arg, default=5.0, metavar="S",
                   help="seconds to wait for a remote store, or a duration like 250ms "
                   "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


@contextmanager
def opened(args: argparse.Namespace):
    """The tiers STORE or --config name; closed afterwards."""
    if bool(args.store) == bool(args.config):
        raise ConfigError("give either STORE or --config FILE")
    if args.tier and not args.config:
        raise ConfigError("--tier goes with --config")
    tiers = open_config(args.config, timeout=args.timeout, only=args.tier) if args.config else \
        [open_tier(args.store, timeout=args.timeout)]
    try:
        yield tiers
    finally:
        for tier in tiers:
            tier.close()


@contextmanager
def opened_url(url: str, args: argparse.Namespace, *, create: bool = False, name: str = "store",
               room: Callable[[], int] = lambda: 0):
    """The store at ``url`` (with ``create``: the copy destination, created when new, with room
    for ``room()`` bytes); closed afterwards."""
    tier: Tier = (open_destination(url, name=name, timeout=args.timeout, room=room) if create
                  else open_tier(url, name=name, timeout=args.timeout))
    try:
        yield tier
    finally:
        tier.close()


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def timeout_arg(text: str) -> float:
    """``--timeout``: a positive duration of at most a day (``inf`` failed every socket call with
    a traceback, ``nan``, ``0`` and ``-1`` were reported as the store being unreachable)."""
    seconds = duration_arg(text)
    if not 0 < seconds <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be positive and at most 1d, got {text!r}")
    return seconds

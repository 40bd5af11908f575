"""The options an ``lmdb://`` URL may carry, a URL's query read against them, and their values
read once: by the tier as it opens and by a config as it is built (nothing opened or made)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage_backends.options import CONFIG_CHECKED, as_int, known_options
from storage_backends.quotas import Quotas
from storage_backends.segment_writeback import writeback_mode
from tiered_kv.errors import ConfigError
from tiered_kv.units import as_bool, parse_size

OPTIONS = ("capacity", "sync", "map_size", "readahead", "writemap", "max_readers", "batch_bytes",
           "record_access", "tenant_quota", "tenant_quotas", "segment_min", "segment_bytes", "writeback",
           "eager_writeback", "direct_io")


@dataclass(frozen=True)
class LmdbSettings:
    """An lmdb tier's options read (:func:`lmdb_settings`)."""

    capacity: int | None  # None: a tool's open (evicts only for tenant quotas)
    quotas: Quotas
    sync: bool
    record_access: bool  # False: tools' reads
    batch_bytes: int
    map_size: int  # 0: the environment's own
    segment_min: int  # values of at least this many bytes go to segment files...
    segment_bytes: int  # ... of this many bytes each
    writeback: str  # segment_writeback.MODES
    direct_io: bool  # segment values written with O_DIRECT
    writemap: bool
    readahead: bool
    max_readers: int


def lmdb_settings(capacity: int | str | None, *, sync: bool | str = False, map_size: int | str | None = None,
                  readahead: bool | str = True, writemap: bool | str = False, max_readers: int | str = 512,
                  batch_bytes: int | str = 2 << 20, record_access: bool | str = True,
                  tenant_quota: int | str | None = None, tenant_quotas=None, segment_min: int | str = 64 << 10,
                  segment_bytes: int | str = 128 << 20, writeback: str | None = None,
                  eager_writeback: bool | str = False, direct_io: bool | str = False) -> LmdbSettings:
    """The options' values (bytes, strings from a URL) checked and read; ConfigError naming the
    option. The only reading of them: the tier's constructor and :func:`check_options` call it."""
    size = None if capacity is None else parse_size(capacity, name="lmdb capacity")
    if size is not None and size <= 0:
        raise ConfigError(f"lmdb capacity must be positive, got {capacity!r}")
    quotas = Quotas.from_options("lmdb", tenant_quota, tenant_quotas)
    flags = {name: as_bool(value, f"lmdb {name}") for name, value in (("sync", sync), ("record_access", record_access))}
    # 1-2 MiB per write transaction amortises the commit; 4+ MiB faults fresh pages
    batch = parse_size(batch_bytes, name="lmdb batch_bytes")
    wanted = parse_size(map_size, name="lmdb map_size") if map_size is not None else \
        0 if size is None else max(2 * size, size + (1 << 30))
    minimum, per_file = parse_size(segment_min, name="lmdb segment_min"), parse_size(segment_bytes, name="lmdb segment_bytes")
    if minimum < 1 or per_file < (1 << 20):
        raise ConfigError(f"lmdb segment_min must be >= 1 and segment_bytes >= 1 MiB, got {segment_min!r}, "
                          f"{segment_bytes!r}")
    # when the disk is written behind the page cache (eager_writeback: the older spelling)
    mode = writeback_mode(writeback, as_bool(eager_writeback, "lmdb eager_writeback"))
    return LmdbSettings(size, quotas, flags["sync"], flags["record_access"], batch, wanted, minimum, per_file, mode,
                        as_bool(direct_io, "lmdb direct_io"), as_bool(writemap, "lmdb writemap"),
                        as_bool(readahead, "lmdb readahead"), as_int(max_readers, "lmdb max_readers"))


def url_options(url: str, options: dict) -> dict:
    """The URL's query with ``options`` over it (None: not given); unknown names refused."""
    return known_options("lmdb", url, options, OPTIONS)


def check_options(url: str, options: dict) -> None:
    """The options of an ``lmdb:`` tier checked as its config is built, names and values (a
    ``map_size = "abc"`` was a config until the tier opened, in the engine's worker), as the tier
    reads them; nothing is opened or made (:data:`~storage_backends.options.CONFIG_CHECKED`: the
    config's own)."""
    query = {k: v for k, v in url_options(url, options).items() if k not in CONFIG_CHECKED}
    lmdb_settings(None, **query)


def store_directory(path: Path) -> None:
    """Make the store's directory where it is missing; ConfigError where ``path`` is no directory
    or cannot be made (a missing or read-only parent raised OSError into an engine's scheduler)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"lmdb path {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"lmdb path {path} cannot be made: {exc.strerror or exc}") from None

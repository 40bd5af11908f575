"""Tables a read-only open found missing (a store of an older format, which a writer would
upgrade): a :class:`MissingTable` stands in for each one's handle, and the transactions of that
environment come wrapped in :class:`WithMissing`, which reads such a table as empty. Nothing is
ever written to one: the first write of the process creates the tables and settles the format
(:meth:`storage_backends.lmdb_environment.LmdbEnvironment.write`)."""

from __future__ import annotations

from collections.abc import Iterator

import lmdb


class MissingTable:
    """The handle of a table that does not exist (yet): reads find nothing in it."""

    def __init__(self, name: bytes) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"MissingTable({self.name!r})"


def open_existing(env: lmdb.Environment, names: tuple[bytes, ...]) -> list[object]:
    """Each named table's handle, or a :class:`MissingTable`; nothing is created (a write
    transaction that changes nothing commits without writing: LMDB keeps the handles a read
    transaction opened only until it ends)."""
    handles: list[object] = []
    with env.begin(write=True) as txn:
        for name in names:
            try:
                handles.append(env.open_db(name, txn=txn, create=False))
            except lmdb.NotFoundError:
                handles.append(MissingTable(name))
    return handles


class EmptyCursor:
    """A cursor over a missing table: positioned nowhere, iterating nothing."""

    def set_range(self, key) -> bool:
        return False

    def set_key(self, key) -> bool:
        return False

    def first(self) -> bool:
        return False

    def last(self) -> bool:
        return False

    def iternext(self, keys: bool = True, values: bool = True) -> Iterator:
        return iter(())

    def iterprev(self, keys: bool = True, values: bool = True) -> Iterator:
        return iter(())

    def __iter__(self) -> Iterator:
        return iter(())

    def close(self) -> None:
        pass


def raw_txn(txn):
    """The lmdb transaction itself (what ``open_db`` takes), wrapped or not."""
    return txn._txn if isinstance(txn, WithMissing) else txn


class WithMissing:
    """A transaction whose reads of a :class:`MissingTable` find nothing; the rest is the
    transaction's own."""

    def __init__(self, txn) -> None:
        self._txn = txn

    def get(self, key, default=None, db=None):
        if isinstance(db, MissingTable):
            return default
        return self._txn.get(key, default, db=db)

    def cursor(self, db=None):
        if isinstance(db, MissingTable):
            return EmptyCursor()
        return self._txn.cursor(db=db)

    def __getattr__(self, name: str):
        return getattr(self._txn, name)

"""What the ``tiered-kv`` command does to stores, one module per verb family (``tiered_kv.cli``
parses the arguments and renders what these return):

- ``opening``: open a store read-only by URL, directory or a config file's lower tiers
  (``Tier``); the copy destination is the one store that may be created;
- ``catalog``: what a store holds — its entries with sizes, times and hits, its namespace
  records, and which namespace a ``--namespace`` option names;
- ``block_checks``: the block a namespace stores, and checking a stored block as the store would;
- ``inventory``: ``inspect`` (per tier and namespace), ``ls`` (filtered listings), ``show`` (one
  entry, with per-layer K/V statistics);
- ``tenants``: usage per tenant (``cache_salt`` label) and quota, for ``inspect``;
- ``verify``: every stored entry checked, bad ones (optionally) removed;
- ``explain``: which blocks of a prompt each tier holds, and why reuse stops where it stops;
- ``evict_copy``: ``evict`` (by size, age or namespace) and ``copy`` (from one medium to another);
- ``stats``: a running store's Prometheus metrics, summarised.
"""

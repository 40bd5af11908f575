"""What the ``tiered-kv`` command does to stores, one module per verb family: open a store
read-only and list its entries (``catalog``), ``inspect`` / ``ls`` / ``show`` (``inventory``),
``verify``, ``explain``, ``evict`` / ``copy`` (``evict_copy``)."""

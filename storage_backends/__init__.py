"""Storage media behind one small interface, chosen by URL through a lazy registry.

Backends store opaque byte values under opaque byte keys; they know nothing of the connector.
"""

from storage_backends.base import Backend, BackendStats
from storage_backends.registry import open_backend, register_backend, registered_schemes

__all__ = ["Backend", "BackendStats", "open_backend", "register_backend", "registered_schemes"]

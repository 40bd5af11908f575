"""One AES-256-GCM key per tenant, derived from the configured encryption secret.

``key = HKDF-SHA256(secret, salt = SALT, info = INFO ‖ tenant label, 32 bytes)``: the tenant
label is :func:`tiered_kv.keys.tenant_label` of the request's ``cache_salt`` (``b""`` for none),
so every tenant's blocks are sealed under their own key and the salt itself is never an input
anyone sees. Keys are derived once per tenant and kept (a few hundred bytes each, at most
MAX_TENANTS; beyond that they are derived again on use). The ``cryptography`` library (the
``crypto`` extra) is imported only when a secret is configured. No torch here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tiered_kv.config import MIN_SECRET_BYTES
from tiered_kv.errors import ConfigError
from tiered_kv.store.codec_sealed import Sealing

SALT = b"tiered-kv encryption at rest"
INFO = b"tiered-kv/block-key/v1:"
MAX_TENANTS = 4096  # derived keys kept


def derive_key(secret: bytes, tenant: bytes) -> bytes:
    """The 32-byte AES key of ``tenant`` under ``secret``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=SALT, info=INFO + tenant).derive(secret)


class TenantCipher:
    """The ciphers of every tenant under one secret (bytes); :meth:`sealing` hands one out."""

    def __init__(self, secret: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise ConfigError("encryption_secret needs the cryptography library: "
                              "pip install 'tiered-kv[crypto]'") from None
        # checked here too, not only where the config parses its text: a Secret handed to the
        # config as an object skips that parse, and a 1-byte secret sealed every block under a
        # key anyone could guess (the value itself is never quoted)
        if not isinstance(secret, (bytes, bytearray, memoryview)) or len(bytes(secret)) < MIN_SECRET_BYTES:
            raise ConfigError(f"encryption_secret must be a secret of at least {MIN_SECRET_BYTES} bytes")
        self._aesgcm = AESGCM
        self._secret = bytes(secret)
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Sealing] = OrderedDict()

    def __repr__(self) -> str:
        return f"TenantCipher(<secret redacted>, {len(self._cache)} tenants)"

    def sealing(self, tenant: bytes) -> Sealing:
        """``tenant``'s cipher (AESGCM objects are safe to share between threads); ``tenant``
        any bytes-like label, as the media take it (a bytearray one is not hashable)."""
        tenant = bytes(tenant)
        with self._lock:
            found = self._cache.get(tenant)
            if found is not None:
                self._cache.move_to_end(tenant)
                return found
        made = Sealing(self._aesgcm(derive_key(self._secret, tenant)), tenant)
        with self._lock:
            self._cache[tenant] = made
            while len(self._cache) > MAX_TENANTS:
                self._cache.popitem(last=False)
        return made

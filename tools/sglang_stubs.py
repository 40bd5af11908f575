"""Stand-ins for the packages SGLang 0.5.23 imports but this CPU-only check cannot install.

tools/check_sglang.sh copies this file into .venv-sglang/sglang-stubs/ and adds a .pth line that
imports it at interpreter start-up; it is never on the repository's import path.

- ``sgl_kernel``: CUDA-only kernels. SGLang's own ``sglang.test.test_utils.maybe_stub_sgl_kernel``
  does the same thing (every attribute is a MagicMock), but importing that module pulls in
  SGLang's benchmark stack; this finder needs nothing.
- ``torchvision`` (no build beside the CPU torch 2.13 wheel) and ``datasets``: imported at module
  level by SGLang's multimodal configs, benchmark helpers and by transformers once torchvision
  looks installed; nothing on the HiCache path calls into them.

The finder sits at the END of ``sys.meta_path``, so a real installation of any of these packages
always wins. Every attribute of a stand-in module is a MagicMock, so a call into one does not
fail at import time but returns mocks: tests must never depend on them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_STUBBED = ("sgl_kernel", "torchvision", "datasets")
_VERSIONS = {"torchvision": "0.0.0", "datasets": "0.0.0", "sgl_kernel": "0.0.0"}


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from unittest.mock import MagicMock

        root = module.__name__.split(".")[0]
        module.__version__ = _VERSIONS[root]
        module.__path__ = []
        module.__tiered_kv_stub__ = True

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = MagicMock(name=f"{module.__name__}.{name}")
            setattr(module, name, value)
            return value

        module.__getattr__ = __getattr__


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in _STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def install() -> None:
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())


install()

"""Fixtures for the KV-copy kernel tests: the Triton kernels built for Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set only while
``kernels.kv_copy`` is imported (or re-imported, if something imported it compiled) and restored
afterwards: engines that other tests start in subprocesses do not inherit it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


def _import_interpreted_kv_copy() -> ModuleType:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = sys.modules.get("kernels.kv_copy")
        if module is None:
            module = importlib.import_module("kernels.kv_copy")
        elif not module.INTERPRETED:
            module = importlib.reload(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert module.INTERPRETED
    return module


@pytest.fixture(scope="session")
def kv_copy() -> ModuleType:
    import triton  # noqa: F401  (imported before TRITON_INTERPRET is set: its gluon module asserts otherwise)

    return _import_interpreted_kv_copy()

"""Strata: a distributed multilevel-secure data stream management system.

``strata.connect(master, user, level, tls_dir=..., password=...)`` opens a session with a level's
master (the Python API: :mod:`strata.api`)."""

import importlib

__version__ = "0.1.0"

__all__ = ["connect", "__version__"]


def __getattr__(name):
    if name == "connect":
        # deferred: strata.api loads pyarrow and gRPC, which `strata --help` (this package's CLI) does not need
        return importlib.import_module("strata.api").connect
    raise AttributeError(f"module 'strata' has no attribute {name!r}")

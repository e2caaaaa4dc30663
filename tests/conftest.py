"""Test-wide settings: one persistent XLA compilation cache for the whole run.

Every emulated host is a fresh process that compiles the same programs; a
shared on-disk cache (new for each pytest run) lets them compile once.
"""

import os
import tempfile

_cache = tempfile.mkdtemp(prefix="hetjax-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

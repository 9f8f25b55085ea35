"""Test-session setup: a private kernel cache, so the suite leaves nothing in the home folder.

pytest imports this file before any test module, so before anything imports jax_sm100. The
session's first process makes a temporary folder (0700, as the cache requires; disk_cache.py,
"Trust"), points `JAX_SM100_CACHE_DIR` at it and removes it when it exits; pytest-xdist workers
and the child processes tests start inherit the variables and share that folder (the cache is
safe across processes), so a kernel is compiled once per run.

`JAX_SM100_TEST_CACHE_DIR=<folder>` uses that folder instead and keeps it (to keep kernels
between runs of the GPU suites, say); the folder must be private to you.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_SESSION_ENV = "JAX_SM100_TEST_SESSION_CACHE"  # set by the process that owns the folder

_keep = os.environ.get("JAX_SM100_TEST_CACHE_DIR", "").strip()
_session = os.environ.get(_SESSION_ENV, "").strip()
if _keep:
    os.environ["JAX_SM100_CACHE_DIR"] = _keep
elif _session and os.path.isdir(_session):
    os.environ["JAX_SM100_CACHE_DIR"] = _session
else:
    _tmp = tempfile.mkdtemp(prefix="jax_sm100_test_cache_")
    os.environ["JAX_SM100_CACHE_DIR"] = os.environ[_SESSION_ENV] = _tmp
    atexit.register(shutil.rmtree, _tmp, ignore_errors=True)

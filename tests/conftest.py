"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled programs are cached on disk across tests and processes (the CLI and subprocess
# tests build engines whose programs the fixtures already compiled).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jetserve-test-jax-cache")
# The CLI's own default (~/.cache/jetserve/xla) would be taken by `jetserve` subprocesses.
os.environ.setdefault("JETSERVE_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

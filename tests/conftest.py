"""Test setup: 8 fake CPU devices and fast compiles (tests/xla.py; set before jax is
imported) and shared fixtures."""

import os

import pytest

from tests.xla import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled programs are cached on disk across tests and processes (the CLI and subprocess
# tests build engines whose programs the fixtures already compiled).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jetserve-test-jax-cache")
# The CLI's own default (~/.cache/jetserve/xla) would be taken by `jetserve` subprocesses.
os.environ.setdefault("JETSERVE_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(autouse=True)
def _no_exported_program_cache_after_a_test():
    """A test that runs a command in-process turns the exported-program cache on for the
    process (jetserve/compile_cache.enable): off again after it, so a later test's engine
    traces its programs (trace counts) rather than loading an earlier test's."""
    yield
    from engines import exported_programs

    exported_programs.set_directory(None)


def _memory_mappings() -> tuple[int, int] | None:
    """(this process's memory mappings, the kernel's per-process limit), where Linux says."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_a_module():
    """Drop jax's caches of compiled programs after a test module that leaves this process
    holding over a quarter of its memory-mapping limit. Every live XLA CPU executable
    holds memory mappings of its own; kept for the whole suite they reach the kernel's
    per-process limit (vm.max_map_count, 65,530: a crashed run's core held 65,377), an
    mmap in the next compile fails, and jaxlib 0.10.2 crashes unwinding that compile's
    error (a segfault in libgcc's FDE search). Programs still referenced stay; the next
    module re-reads what it needs from the persistent compile cache. Dropping them after
    every module would cost minutes of recompiling, so it happens only past the mark (and
    after every module where the mappings cannot be counted)."""
    yield
    mappings = _memory_mappings()
    if mappings is not None and mappings[0] < mappings[1] // 4:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_terminal_summary(terminalreporter):
    """The process's memory mappings at the end, against the kernel's limit (see
    _release_compiled_programs_after_a_module); not where the tests ran in pytest-xdist's
    worker processes (`-n`), whose controller runs none."""
    mappings = _memory_mappings()
    if mappings is not None and not terminalreporter.config.getoption("numprocesses", None):
        terminalreporter.write_line(f"memory mappings at the end: {mappings[0]:,} of "
                                    f"{mappings[1]:,} (vm.max_map_count)")

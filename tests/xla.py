"""XLA flags for the tests' processes (pytest's own and the servers it starts).

`n` fake CPU devices, and LLVM's cheap pipeline for the CPU backend: the tests compile
hundreds of tiny programs and run each for a few steps, so compile time is most of their
time, and -O0 roughly a third less of it. The flags change how fast code runs, not what
it computes; benchmarks and servers outside the tests keep XLA's defaults.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process of the tests with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"

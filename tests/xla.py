"""XLA flags for the tests' processes (pytest's own and the servers it starts).

`n` fake CPU devices, and cheap compiles for the CPU backend: the tests compile hundreds
of tiny programs and run each for a few steps, so compile time is most of their time.
LLVM's -O0 takes roughly a third off it. The CPU backend's older fusion emitters
(`--xla_cpu_use_fusion_emitters=false`) take about two thirds off what is left of XLA's
part: `jetserve generate` on random:tiny with paged KV compiles its 8 programs in 4.6-5.6 s
instead of 8.1-9.9 s, of which tracing and lowering are 3.0-3.8 s either way
(docs/BENCHMARKS.md, "Test-suite compile flags"). The flags change how fast code runs, not
what it computes; benchmarks and servers outside the tests keep XLA's defaults.
"""

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
# A sharded program over several fake devices on 2 busy cores: XLA's CPU scheduler for
# concurrency let two devices each wait in two collectives at once (an all-gather and an
# all-reduce), the other two devices never joined, and XLA ended the process after its
# 40 s rendezvous timeout (tests/engines/test_layer_scan.py's sharded mesh beside two
# busy loops: 2 of 2 runs, and twice in two-process runs of the suite). Without that
# scheduler, 2 of 2 runs beside the busy loops passed.
NO_CONCURRENCY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process of the tests with `devices` fake CPU devices."""
    return (f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE} "
            f"{NO_CONCURRENCY_SCHEDULER}")

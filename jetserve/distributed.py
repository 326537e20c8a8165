"""Which devices a command runs on: `--devices N`, and several hosts through jax.distributed.

Several hosts (JAX's multi-controller runtime): every process runs the same program on
the same inputs. `setup` joins the processes (`jax.distributed.initialize`) before JAX
touches a device; afterwards `jax.devices()` lists the devices of all processes and an
engine's mesh spans them. Process 0 (`is_primary()`) owns request intake and printing;
every process must call prefill / insert / generate in the same order with the same
inputs, since each call is one SPMD program over all of them. Work that arrives at
process 0 only (a server's requests) reaches the others through `broadcast_from_primary`.

LeaderWorkerSet (Kubernetes): a pod of a group gets LWS_LEADER_ADDRESS (the leader pod's
address), LWS_GROUP_SIZE and LWS_WORKER_INDEX (0 on the leader); `setup` reads them as
--coordinator ADDRESS:COORDINATOR_PORT, --num-processes and --process-id where those flags
are not given (flags win), so one manifest starts every pod with the same arguments.

On CPU, collectives between processes go through gloo, so 2 processes x 4 fake devices on
127.0.0.1 stand in for two hosts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np

# The coordinator's port on the leader when LWS_LEADER_ADDRESS names no port.
COORDINATOR_PORT = 8476
_LWS = (("coordinator", "LWS_LEADER_ADDRESS"), ("num_processes", "LWS_GROUP_SIZE"),
        ("process_id", "LWS_WORKER_INDEX"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices and hosts")
    g.add_argument("--devices", type=int, default=None,
                   help="use the first N devices (of all processes); on CPU, N fake devices "
                        "are made when XLA_FLAGS does not set a count")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, for a run over several processes (default: "
                        f"$LWS_LEADER_ADDRESS, port {COORDINATOR_PORT} unless it names one)")
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes in the run (default: $LWS_GROUP_SIZE)")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's index, 0 serves (default: $LWS_WORKER_INDEX)")


def from_lws_environment(args: argparse.Namespace, environ=os.environ) -> None:
    """Fills --coordinator / --num-processes / --process-id that were not given from
    LeaderWorkerSet's environment (nothing when LWS_GROUP_SIZE is unset or 1)."""
    size = environ.get("LWS_GROUP_SIZE")
    if size is None or size.strip() == "1":
        return
    for field, var in _LWS:
        if getattr(args, field, None) is not None:
            continue  # the flag wins
        value = environ.get(var)
        if value is None:
            raise ValueError(f"LWS_GROUP_SIZE={size} is set but {var} is not (or give "
                             f"--{field.replace('_', '-')})")
        if field == "coordinator":
            host, _, port = value.rpartition(":")
            value = value if host and port.isdigit() else f"{value}:{COORDINATOR_PORT}"
        else:
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"{var} must be an integer, got {value!r}") from None
        setattr(args, field, value)


def setup(args: argparse.Namespace) -> list[jax.Device]:
    """Joins the processes (if asked, by flags or LeaderWorkerSet's environment) and
    returns the devices to build engines on."""
    from_lws_environment(args)
    n_proc = getattr(args, "num_processes", None)
    initialize(getattr(args, "coordinator", None), n_proc, getattr(args, "process_id", None))
    n = getattr(args, "devices", None)
    if n is not None:
        if n < 1:
            raise ValueError(f"--devices must be >= 1, got {n}")
        per_process = -(-n // (n_proc or 1))
        request_cpu_devices(per_process)
    return select_devices(n)


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None) -> None:
    """jax.distributed.initialize with gloo CPU collectives; nothing when coordinator is None."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    if coordinator is None:
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} need --coordinator HOST:PORT")
        return
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"--coordinator needs {' and '.join(missing)} too")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    # Only the CPU backend reads this; on TPU/GPU the collectives are the chips' own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _native_stdout_to_stderr()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def _native_stdout_to_stderr() -> None:
    """Keeps stdout for our output (`--json` lines are parsed by programs).

    gloo prints a line to the process's stdout for every communicator it connects; from
    here on, whatever native code writes to fd 1 goes to stderr, and Python's sys.stdout
    writes to the original stdout.
    """
    sys.stdout.flush()
    encoding = sys.stdout.encoding or "utf-8"
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(original, "w", buffering=1, encoding=encoding)  # noqa: SIM115


def request_cpu_devices(n: int) -> None:
    """Asks for n fake CPU devices, unless XLA_FLAGS sets a count or JAX already started.

    Harmless on TPU/GPU hosts: only the CPU backend reads it.
    """
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialized: use what exists
        pass


def select_devices(n: int | None) -> list[jax.Device]:
    """The first n devices of all processes (all of them when n is None)."""
    devices = jax.devices()
    if n is None:
        return list(devices)
    if jax.process_count() > 1 and n != len(devices):
        # Every process must own devices of the mesh to take part in its steps.
        raise ValueError(
            f"--devices {n}: with {jax.process_count()} processes every device takes part; "
            f"give --devices {len(devices)} or leave it out"
        )
    if n > len(devices):
        hint = ""
        if devices[0].platform == "cpu":
            hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{n} before starting, or leave XLA_FLAGS unset and --devices makes them)")
        raise ValueError(
            f"--devices {n}: only {len(devices)} {devices[0].platform} devices exist{hint}"
        )
    return list(devices[:n])


def is_primary() -> bool:
    """True in process 0, which owns request intake and output."""
    return jax.process_index() == 0


def broadcast_from_primary(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Process 0's integer array, on every process (the others pass a same-shape array)."""
    if jax.process_count() == 1:
        return np.asarray(values)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values)))

"""Checks made before a batch job loads its model, so that a mistake costs no load.

`check_paths`: --output must not be --input (resuming would read the input rows as
results; a fresh run would append results to the input), however the two are spelt
(symlinks, hard links, relative paths).

`check_coordinator_port`: process 0 of a --coordinator run hosts jax.distributed's
coordination service on that port. Bound to a port another program holds, the service
fails inside native code and takes the process down with a segmentation fault, so the
port is tried first, the way the service binds it (every interface, IPv6 and IPv4), and
a taken one is a clear error. (Another program could still take it in the moment between
the check and the bind; that race ends as before, never silently.)
"""

from __future__ import annotations

import errno
import os
import socket


def same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_paths(input_path: str, output: str) -> None:
    if same_file(input_path, output):
        raise ValueError(f"--output {output} is the same file as --input {input_path}; "
                         "write the results to a file of their own")


def check_coordinator_port(coordinator: str, process_id: int | None) -> None:
    """Raises ValueError when process 0's coordinator port is taken (others only connect)."""
    if process_id != 0:
        return
    _, _, port = coordinator.rpartition(":")
    if not port.isdigit():
        return  # jetserve.distributed names the format
    if not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {coordinator}: port must be in [1, 65535]")
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        where = ("::", int(port))
    except OSError:  # no IPv6 here
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        where = ("0.0.0.0", int(port))
    with sock:
        # As the service does: a port left in TIME_WAIT by an earlier run is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(where)
        except OSError as e:
            why = ("is already in use by another program" if e.errno == errno.EADDRINUSE
                   else f"cannot be bound ({e.strerror})")
            raise ValueError(f"--coordinator {coordinator}: port {port} {why}; process 0 "
                             "hosts the coordinator there: choose a free port (the same "
                             "for every process)") from None

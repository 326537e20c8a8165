"""ServerConfig: where and how `jetserve serve` listens (the server's one config)."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Network-facing settings of the gRPC and HTTP servers.

    Ports: 0 picks a free port (the servers report the real one); None disables that server.
    """

    host: str = "0.0.0.0"
    grpc_port: int | None = 9000
    http_port: int | None = 8000
    api_key: str | None = None  # HTTP `Authorization: Bearer KEY`; gRPC metadata
    tls_cert: str | None = None  # PEM files; TLS for gRPC when both are given
    tls_key: str | None = None
    model_name: str = "jetserve"  # the id /v1/models reports and requests must name
    drain_timeout_s: float = 60.0  # SIGTERM: how long in-flight streams may take to finish
    # A stream whose client accepts nothing for this long (its socket send or gRPC write
    # blocks) is cancelled and its connection closed, so a reader that stopped reading
    # cannot hold a slot and its queued output.
    write_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("grpc_port", "http_port"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 65535):
                raise ValueError(f"{name} must be an integer in [0, 65535], got {v!r}")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("grpc_port and http_port are both None: nothing to serve")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; omit it to serve without authentication")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together, got "
                             f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if not self.model_name:
            raise ValueError("model_name is empty")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if not self.write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0 seconds, got {self.write_timeout_s!r}")

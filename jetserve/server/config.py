"""ServerConfig: where and how `jetserve serve` listens (the server's one config)."""

from __future__ import annotations

import dataclasses
import math
import os
import ssl

from jetserve.generation_config import GenerationDefaults
from jetserve.server import reasoning
from jetserve.server.tool_formats import DEFAULT_PARSER, check_parser

# GET /get_load's shapes: vllm-router's {"load": N}, sglang-router's list (probes.py).
LOAD_FORMATS = ("vllm-router", "sglang")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Network-facing settings of the gRPC and HTTP servers.

    Ports: 0 picks a free port (the servers report the real one); None disables that server.
    """

    host: str = "0.0.0.0"
    grpc_port: int | None = 9000
    http_port: int | None = 8000
    api_key: str | None = None  # `Authorization: Bearer KEY` or `x-api-key: KEY`, both servers
    tls_cert: str | None = None  # PEM files; TLS for both servers when both are given
    tls_key: str | None = None
    model_name: str = "jetserve"  # the id /v1/models reports and requests must name
    drain_timeout_s: float = 60.0  # SIGTERM: how long in-flight streams may take to finish
    # SIGTERM: how long health answers 503 (gRPC NOT_SERVING) while the servers still take
    # requests, before they stop accepting: routers polling it move traffic elsewhere first.
    drain_notice_s: float = 0.0
    load_format: str = "vllm-router"
    # HTTP connection limits (jetserve.server.http_limits), seconds and bytes.
    header_timeout_s: float = 10.0  # request headers, from connecting or their first byte
    body_timeout_s: float = 30.0  # the whole body, from its headers
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed
    max_body_bytes: int = 16 * 2**20  # well above a 128k-token prompt as JSON
    # Per request, both protocols: prompts in one body, and prompts x n sub-requests.
    max_prompts_per_request: int = 64
    max_sub_requests: int = 64
    # A stream whose client accepts nothing for this long (its socket send or gRPC write
    # blocks) is cancelled and its connection closed, so a reader that stopped reading
    # cannot hold a slot and its queued output.
    write_timeout_s: float = 30.0
    # The format chat tool_choice "auto" reads calls in (jetserve.server.tool_formats).
    tool_call_parser: str = DEFAULT_PARSER
    # How the model writes its thinking (jetserve.server.reasoning); None: in content.
    reasoning_parser: str | None = None
    # The model's default sampling (its generation_config.json, --generation-config auto):
    # what a request that sets none of temperature, top_p, ... max_tokens gets.
    generation_defaults: GenerationDefaults = GenerationDefaults()

    def __post_init__(self):
        check_parser(self.tool_call_parser, "tool_call_parser")
        reasoning.check_parser(self.reasoning_parser, "reasoning_parser")
        for name in ("grpc_port", "http_port"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 65535):
                raise ValueError(f"{name} must be an integer in [0, 65535], got {v!r}")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("grpc_port and http_port are both None: nothing to serve")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; omit it to serve without authentication")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            # Headers and gRPC metadata carry printable ASCII: another key could never match.
            raise ValueError("api_key must be printable ASCII (no newlines or control "
                             "characters)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together, got "
                             f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if self.tls_cert is not None and self.tls_key is not None:
            _check_tls_pair(self.tls_cert, self.tls_key)
        if not self.model_name:
            raise ValueError("model_name is empty")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got "
                             f"{self.load_format!r}")
        if not self.drain_notice_s >= 0:
            raise ValueError(f"drain_notice_s must be >= 0, got {self.drain_notice_s!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        for name in ("max_body_bytes", "max_prompts_per_request", "max_sub_requests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0 seconds, got {self.write_timeout_s!r}")


def _check_tls_pair(cert: str, key: str) -> None:
    """Loads the pair once, so a bad one is refused before a model loads, not after.

    The empty password makes an encrypted key an error here; without it OpenSSL would
    prompt on the terminal (neither server could decrypt it either).
    """
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"tls_cert {cert!r} and tls_key {key!r} must be a PEM certificate "
                         f"(chain) and its unencrypted private key: {e}") from None

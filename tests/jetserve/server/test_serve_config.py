"""`jetserve serve` arguments -> ServerConfig and orchestrator layout; config validation."""

import pytest

from jetserve.cli import build_parser
from jetserve.commands import serve
from jetserve.server.config import ServerConfig


def _args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_serve_both_protocols_on_the_usual_ports():
    c = serve.server_config(_args())
    assert (c.grpc_port, c.http_port, c.api_key, c.tls_cert) == (9000, 8000, None, None)


def test_ports_keys_and_names(monkeypatch):
    c = serve.server_config(_args("--grpc-port", "0", "--http-port", "-1", "--api-key", "k",
                                  "--served-model-name", "m"))
    assert (c.grpc_port, c.http_port, c.api_key, c.model_name) == (0, None, "k", "m")
    assert serve.server_config(_args("--model", "random:tiny")).model_name == "random:tiny"
    with pytest.raises(ValueError, match="--grpc-port"):
        serve.server_config(_args("--grpc-port", "70000"))


@pytest.mark.parametrize("argv, layout", [
    ((), dict(interleaved=True, prefill_devices=None, generate_devices=None)),
    (("--prefill-devices", "2", "--generate-devices", "6"),
     dict(interleaved=False, prefill_devices=2, generate_devices=6)),
    (("--interleaved", "--generate-devices", "4"),
     dict(interleaved=True, prefill_devices=None, generate_devices=4)),
])
def test_device_layout_goes_to_orchestrator_build(monkeypatch, argv, layout):
    from jetserve import orchestrator

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw) or "orch")
    assert serve.build_orchestrator(_args("--model", "random:tiny", *argv)) == "orch"
    assert {k: seen[k] for k in layout} == layout
    assert seen["engine_config"].max_seq_len == 1024


def test_half_a_disaggregated_layout_is_an_error():
    with pytest.raises(ValueError, match="go together"):
        serve.build_orchestrator(_args("--prefill-devices", "2"))


@pytest.mark.parametrize("kw, field", [
    (dict(grpc_port=-5), "grpc_port"),
    (dict(grpc_port=None, http_port=None), "grpc_port"),
    (dict(api_key="  "), "api_key"),
    (dict(tls_cert="/nonexistent.pem"), "tls_cert"),
    (dict(tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"), "tls_cert"),
    (dict(drain_timeout_s=-1.0), "drain_timeout_s"),
])
def test_server_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kw)


def test_write_timeout_flag_and_its_check():
    assert serve.server_config(_args()).write_timeout_s == 30.0
    assert serve.server_config(_args("--write-timeout", "2.5")).write_timeout_s == 2.5
    with pytest.raises(ValueError, match="write_timeout_s must be > 0"):
        ServerConfig(write_timeout_s=0)

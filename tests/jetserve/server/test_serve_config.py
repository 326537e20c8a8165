"""`jetserve serve` arguments -> ServerConfig and orchestrator layout; config validation."""

import pytest

from jetserve.cli import build_parser
from jetserve.commands import serve
from jetserve.model_loading import RANDOM_MODELS
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


def test_connection_limit_flags_reach_the_config():
    d = serve.server_config(_args())
    assert (d.header_timeout_s, d.body_timeout_s, d.keep_alive_timeout_s) == (10.0, 30.0, 5.0)
    assert 50 * 2**20 > d.max_body_bytes >= 4 * 2**20  # refuses the 50 MB body; fits 128k tokens
    c = serve.server_config(_args("--header-timeout", "2", "--body-timeout", "3",
                                  "--keep-alive-timeout", "4", "--max-body-bytes", "1000",
                                  "--max-prompts-per-request", "5", "--max-sub-requests", "6"))
    assert (c.header_timeout_s, c.body_timeout_s, c.keep_alive_timeout_s, c.max_body_bytes,
            c.max_prompts_per_request, c.max_sub_requests) == (2.0, 3.0, 4.0, 1000, 5, 6)


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
    # No --max-seq-len: random:tiny's own context (its KV cache fits on this host).
    assert seen["engine_config"].max_seq_len == RANDOM_MODELS["tiny"].max_position_embeddings


def test_half_a_disaggregated_layout_is_an_error():
    with pytest.raises(ValueError, match="go together"):
        serve.build_orchestrator(_args("--prefill-devices", "2"))


@pytest.mark.parametrize("kw, field", [
    (dict(grpc_port=-5), "grpc_port"),
    (dict(grpc_port=None, http_port=None), "grpc_port"),
    (dict(api_key="  "), "api_key"),
    (dict(api_key="k\ney"), "api_key"),
    (dict(tls_cert="/nonexistent.pem"), "tls_cert"),
    (dict(tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"), "tls_cert"),
    (dict(drain_timeout_s=-1.0), "drain_timeout_s"),
    (dict(header_timeout_s=0), "header_timeout_s"),
    (dict(body_timeout_s=float("inf")), "body_timeout_s"),
    (dict(keep_alive_timeout_s=-1), "keep_alive_timeout_s"),
    (dict(max_body_bytes=0), "max_body_bytes"),
    (dict(max_prompts_per_request=1.5), "max_prompts_per_request"),
    (dict(max_sub_requests=True), "max_sub_requests"),
])
def test_server_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**kw)


def test_api_key_from_a_file_the_flag_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("\n  from-file \n")
    monkeypatch.setenv("JETSERVE_API_KEY", "from-env")
    assert serve.server_config(_args("--api-key-file", str(path))).api_key == "from-file"
    assert serve.server_config(_args("--api-key", "from-flag")).api_key == "from-flag"
    assert serve.server_config(_args()).api_key == "from-env"
    with pytest.raises(SystemExit):  # argparse: not allowed with argument --api-key
        _args("--api-key", "k", "--api-key-file", str(path))


@pytest.mark.parametrize("content, message", [
    ("  \n", "is empty"), (None, "cannot read it: No such file or directory"),
    ("a\nb", "one line of printable ASCII"), ("kéy", "one line of printable ASCII"),
])
def test_a_bad_api_key_file_is_an_error_naming_it(tmp_path, content, message):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        serve.server_config(_args("--api-key-file", str(path)))
    assert str(e.value).startswith(f"--api-key-file {str(path)!r}")


def test_a_tls_pair_that_does_not_load_is_refused_naming_both(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"tls_cert {str(bad)!r} and tls_key {str(bad)!r}"):
        ServerConfig(tls_cert=str(bad), tls_key=str(bad))


def test_write_timeout_flag_and_its_check():
    assert serve.server_config(_args()).write_timeout_s == 30.0
    assert serve.server_config(_args("--write-timeout", "2.5")).write_timeout_s == 2.5
    with pytest.raises(ValueError, match="write_timeout_s must be > 0"):
        ServerConfig(write_timeout_s=0)


def test_tool_call_parser_flag_its_default_and_a_bad_name(capsys):
    assert serve.server_config(_args()).tool_call_parser == "hermes"  # the bundled template's
    assert serve.server_config(_args("--tool-call-parser", "mistral")).tool_call_parser == \
        "mistral"
    with pytest.raises(SystemExit):
        _args("--tool-call-parser", "granite")
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "'granite'" in err
    assert all(name in err for name in ("hermes", "llama3_json", "mistral", "qwen3_coder",
                                        "pythonic", "deepseek_v3", "glm45", "openai"))
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, "
                                         "llama3_json, mistral, qwen3_coder, pythonic, "
                                         "deepseek_v3, glm45, openai, got 'x'"):
        ServerConfig(tool_call_parser="x")


def test_reasoning_parser_flag_its_default_and_a_bad_name(capsys):
    assert serve.server_config(_args()).reasoning_parser is None  # thinking stays content
    assert serve.server_config(_args("--reasoning-parser", "qwen3")).reasoning_parser == \
        "qwen3"
    with pytest.raises(SystemExit):
        _args("--reasoning-parser", "granite")
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and all(
        name in err for name in ("deepseek_r1", "qwen3", "glm45", "openai_gptoss"))
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, "
                                         "qwen3, glm45, openai_gptoss, got 'x'"):
        ServerConfig(reasoning_parser="x")

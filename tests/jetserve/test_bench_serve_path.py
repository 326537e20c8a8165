"""`jetserve bench serve-path`: its flags are checked before anything starts."""

import os

import pytest

from jetserve.bench import serve_path


def test_defaults_fit_prompt_and_output():
    a = serve_path.parse([])
    assert (a.batch, a.prompt_len, a.output_len, a.max_seq_len) == (8, 16, 256, 384)
    cmd = serve_path.server_command(serve_path.parse(["--batch", "32", "--serve-arg=--no-warmup"]))
    assert cmd[cmd.index("--max-concurrent-decodes") + 1] == "32"
    assert cmd[-1] == "--no-warmup"


@pytest.mark.parametrize("argv, flag", [
    (["--batch", "0"], "--batch"),
    (["--output-len", "1"], "--output-len"),
    (["--prompt-len", "65"], "--prompt-len"),
    (["--max-seq-len", "100"], "--max-seq-len"),
])
def test_bad_flags_are_named(argv, flag):
    with pytest.raises(ValueError, match=flag):
        serve_path.parse(argv)


def test_cpu_seconds_of_this_process_splits_xla_from_the_rest():
    xla, other = serve_path.cpu_seconds(os.getpid())
    assert xla >= 0 and other > 0  # this test's own thread has run


def test_protocols_are_a_list_of_grpc_and_http():
    assert serve_path.parse([]).protocols == ["grpc"]
    assert serve_path.parse(["--protocol", "grpc,http"]).protocols == ["grpc", "http"]
    assert serve_path.parse(["--protocol", "http,http"]).protocols == ["http"]
    with pytest.raises(ValueError, match="--protocol must be grpc, http or both .* got 'grpc,h2'"):
        serve_path.parse(["--protocol", "grpc,h2"])

"""A `jetserve generate` start loads only what generating needs: the servers' frameworks,
torch and transformers, the grammar engine and orbax stay unimported (each costs a warm
start tenths of a second; docs/BENCHMARKS.md, "Issue 21: a lighter warm start").

Each check runs in a fresh interpreter, since this test process imports all of them."""

import json
import subprocess
import sys

# Top-level packages `jetserve generate` never needs: the gRPC and HTTP servers and their
# metrics, the parity and test tooling, the grammar engine (constrained requests only), and
# orbax (the bundled model's checkpoint is read with tensorstore, engines/ocdbt_reader.py).
# Not scipy: calling a cached exported program on the CPU makes jax initialize its LAPACK
# kernels, which come from scipy (about 0.06 s; engines/exported_programs.py).
NOT_FOR_GENERATE = ("grpc", "grpc_health", "grpc_reflection", "fastapi", "starlette",
                    "uvicorn", "prometheus_client", "torch", "transformers", "safetensors",
                    "tokenizers", "matplotlib", "httpx", "openai", "peft",
                    "llguidance", "orbax")

# Runs its argument (a statement), then prints the modules loaded, as JSON.
_REPORT = "import json, sys\n{}\nprint(json.dumps(sorted(sys.modules)))"


def _modules(statement: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", _REPORT.format(statement)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def _loaded(modules: set[str]) -> set[str]:
    """The top-level packages of `modules`."""
    return {m.split(".")[0] for m in modules}


def test_the_command_line_imports_no_server_or_parity_package():
    # The parser imports every subcommand's module: none of them may pull a server in.
    loaded = _loaded(_modules("from jetserve import cli; cli.build_parser()"))
    assert "jax" in loaded  # the probe sees what was imported
    assert not sorted(loaded & {*NOT_FOR_GENERATE, "scipy"})  # no program runs here


def test_generating_with_the_bundled_model_imports_none_of_them(tmp_path):
    modules = _modules(
        "from jetserve import cli\n"
        f"assert cli.main(['generate', '--prompt', 'def add(a, b):', '--max-tokens', '2', "
        f"'--max-seq-len', '64', '--compile-cache', {str(tmp_path / 'cache')!r}]) == 0")
    loaded = _loaded(modules)
    assert {"jax", "flax", "tensorstore", "sentencepiece"} <= loaded  # it did generate
    assert not sorted(loaded & set(NOT_FOR_GENERATE))
    # Only its own subcommand's module: `jetserve generate` builds no other's parser.
    commands = sorted(m for m in modules if m.startswith("jetserve.commands."))
    assert commands == ["jetserve.commands.common", "jetserve.commands.generate"]

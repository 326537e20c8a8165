"""A wheel built from the source tree, installed (not editable) into a fresh venv, runs as
installed: the CPU kernels build from the installed copy's sources and headers, and
`jetserve generate` finds the bundled model inside the package."""

import os
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jetserve", "engines", "sharding", "protos")


def _has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return {"avx2", "fma"} <= set(flags)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding the wheel, that venv's site-packages)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy of what a checkout holds, so the build leaves nothing in the source tree.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(ROOT, pkg), src / pkg, ignore=junk)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("jetserve-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
          "--no-index", "-q", str(wheel)])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                ).stdout.strip()
    # The dependencies from this interpreter's environment, after the venv's own packages
    # (a .pth line is only a path: the editable install's finder there is not loaded).
    deps = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "deps-from-test-env.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    return python, site, wheel


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, JAX_PLATFORMS="cpu", **extra)


@pytest.mark.slow
def test_the_wheel_ships_the_kernel_headers(installed):
    _, _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for h in ("parallel.h", "simd_math.h", "matmul_nt.cc"):
        assert f"engines/csrc/{h}" in names


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or not _has_avx2_fma()
                    or shutil.which(os.environ.get("CXX") or "g++") is None,
                    reason="the CPU kernels need x86_64 with AVX2 and FMA, and g++ (or $CXX)")
def test_the_installed_copy_builds_and_loads_the_cpu_kernels(installed, tmp_path):
    python, site, _ = installed
    kernels = tmp_path / "kernels"  # empty: the kernels compile from the installed sources
    code = ("import engines, jetserve; from engines import cpu_kernels; "
            "print(jetserve.__file__); print(engines.__file__); print(cpu_kernels.available())")
    r = _run([python, "-c", code], cwd=tmp_path, env=_env(JETSERVE_KERNEL_CACHE=str(kernels)))
    jetserve_file, engines_file, available = r.stdout.split()
    assert jetserve_file.startswith(site) and engines_file.startswith(site)
    assert available == "True", r.stderr
    assert [p.suffix for p in kernels.iterdir()] == [".so"]


@pytest.mark.slow
def test_the_installed_command_generates_with_the_bundled_model(installed, tmp_path):
    python, _, _ = installed
    jetserve = os.path.join(os.path.dirname(python), "jetserve")
    r = _run([jetserve, "generate", "--prompt", "def f(", "--max-tokens", "4", "--json",
              "--max-seq-len", "64"], cwd=tmp_path,
             env=_env(JETSERVE_KERNEL_CACHE=str(tmp_path / "kernels")))
    assert '"finish_reason": "length"' in r.stdout, r.stdout

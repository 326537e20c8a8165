"""A self-signed certificate for localhost / 127.0.0.1 (openssl CLI), for TLS tests."""

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path) -> tuple[str, str]:
    """(cert path, key path), both PEM; skips the test when openssl is not installed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, crt = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(crt), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(crt), str(key)

"""Session fixtures: one random-weight HF model per family, written once to a temp dir."""

import pytest

from tests.parity.hf_models import FAMILIES, make_hf_model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """family -> (model dir, torch model)."""
    root = tmp_path_factory.mktemp("hf_models")
    return {f: (str(root / f), make_hf_model(f, str(root / f))) for f in FAMILIES}

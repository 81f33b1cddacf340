from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.tiny import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def pytest_ignore_collect(collection_path, config):
    """On a pytest-xdist worker the fuzz file runs in its own interpreter (test_fuzz_process.py says why); serially
    it runs in this process and the wrapper is not collected."""
    on_worker = hasattr(config, "workerinput")
    if collection_path.name == "test_fuzz.py" and on_worker:
        return True
    if collection_path.name == "test_fuzz_process.py" and not on_worker:
        return True
    return None

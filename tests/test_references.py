"""The checked-in transformers references (tests/data/references/) belong to the installed model files and libraries.

A stale file does not make a parity test wrong (tests/references.py computes a fresh reference then), only slow: this
test is what says it must be regenerated."""
import pytest

from tests.references import SPECS, checked_in_path, stale


@pytest.mark.parametrize("name", sorted(SPECS))
def test_checked_in_reference_matches_the_installed_model_and_transformers(name: str) -> None:
    current, stored = stale(name)
    assert stored == current, (
        f"{checked_in_path(name)} was computed under {stored}, but the installed model and libraries are {current}: "
        f"regenerate it with `python -m tests.references {name}` and commit the file")

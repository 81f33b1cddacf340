"""engine/models/cache_write.py: a cache entry appears whole or not at all, and the first of two writers wins."""
from __future__ import annotations

from pathlib import Path

from engine.models.cache_write import write_atomically


def test_a_folder_appears_whole_and_the_first_writer_wins(tmp_path) -> None:
    target = tmp_path / "cache" / "model.meta"  # the parent is made too

    def write(text: str):
        def fill(tmp: Path) -> None:
            assert not target.exists() or text == "second"  # nothing at the target while the first one writes
            tmp.mkdir()
            (tmp / "config.json").write_text(text)
        return fill

    assert write_atomically(target, write("first")) == target
    assert (target / "config.json").read_text() == "first"
    write_atomically(target, write("second"))  # another process finished first: its copy stays, ours is removed
    assert (target / "config.json").read_text() == "first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.meta"]


def test_a_file_replaces_an_older_one(tmp_path) -> None:
    target = tmp_path / "blocks.safetensors"
    write_atomically(target, lambda tmp: tmp.write_text("old"))
    write_atomically(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["blocks.safetensors"]

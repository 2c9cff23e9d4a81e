"""The GGUF conversion cache stays bounded (v1/models/gguf_cache.py): a new conversion removes
the entries nothing can use again. Conversions here write a config.json alone: what is
converted does not matter to the cache."""

import json
import os
import time
from pathlib import Path

import pytest

from v1.models import gguf_cache


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def convert(path: Path, part: str = "") -> Path:
    """`path`'s entry (`part`: "fp32" for its float copy), converted as the cache does."""
    def write(out: Path) -> None:
        (out / "config.json").write_text("{}")
    return gguf_cache._converted(gguf_cache.converted_dir(path, part), path, write)


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()}


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_entry_records_its_source_and_is_reused_while_the_file_is_unchanged(
        cache, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    first = convert(model)
    assert json.loads((first / gguf_cache.SOURCE).read_text()) == gguf_cache._source(model)
    other = tmp_path / "n.gguf"
    other.write_bytes(b"other")
    convert(other)  # a conversion sweeps: m's entry is still good
    assert convert(model) == first
    assert entries(cache) == {first.name, gguf_cache.converted_dir(other).name}


def test_a_changed_file_s_entries_go_at_the_next_conversion_a_removed_one_s_an_hour_on(
        cache, tmp_path):
    """A file gone may be a mount another process sees: its entries wait an hour."""
    model, other, third = tmp_path / "m.gguf", tmp_path / "n.gguf", tmp_path / "o.gguf"
    model.write_bytes(b"one")
    old, old_fp32 = convert(model), convert(model, "fp32")
    model.write_bytes(b"a new download")
    new = convert(model)
    assert new != old and entries(cache) == {new.name}  # the fp32 copy of the old one too
    assert not old_fp32.exists()
    other.write_bytes(b"other")
    model.unlink()
    kept = convert(other)
    assert entries(cache) == {new.name, kept.name}
    age(new, 2 * gguf_cache._STALE_AGE_S)
    third.write_bytes(b"third")
    converted = convert(third)
    assert entries(cache) == {kept.name, converted.name}


def test_old_layouts_and_leftovers_go_once_an_hour_old(cache, tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    older = convert(model)  # what this code's previous layout version wrote
    monkeypatch.setattr(gguf_cache, "_CONVERSION_VERSION", gguf_cache._CONVERSION_VERSION + 1)
    legacy, young = cache / "m-0123456789abcdef", cache / "n-0123456789abcdef"
    temp, old_temp = cache / ".m-0123456789abcdef.1", cache / ".m-0123456789abcdef.2"
    for d in (legacy, young, temp, old_temp):
        d.mkdir()
        (d / "config.json").write_text("{}")  # no source.json: written before it
    age(legacy, 2 * gguf_cache._STALE_AGE_S)
    age(old_temp, 2 * gguf_cache._STALE_AGE_S)  # a conversion killed long ago
    (cache / "a-file").write_text("not an entry")
    age(cache / "a-file", 2 * gguf_cache._STALE_AGE_S)
    newer = cache / "m-fedcba9876543210"  # another install's newer layout: not ours
    newer.mkdir()
    (newer / gguf_cache.SOURCE).write_text(
        json.dumps({**gguf_cache._source(model), "version": gguf_cache._CONVERSION_VERSION + 1}))
    age(newer, 2 * gguf_cache._STALE_AGE_S)
    current = convert(model)
    assert entries(cache) == {current.name, young.name, temp.name, newer.name, "a-file"}
    assert not older.exists() and not legacy.exists() and not old_temp.exists()

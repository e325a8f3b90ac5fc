"""Packed token windows kept between runs (``nanotron_ext.runtime.data_cache``): read back equal, built again where
the text, the window or the cache file changed, never kept with the cache off. No process: quick."""

from __future__ import annotations

import numpy as np
import pytest

from nanotron_ext.runtime.data import ByteTokenizer, load_packed_windows
from nanotron_ext.runtime.data_cache import DATA_CACHE_ENV, cached_windows


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(DATA_CACHE_ENV, str(folder))
    return folder


def _counting(windows):
    built = []

    def build():
        built.append(1)
        return windows

    return build, built


def test_windows_are_built_once_then_read_back_equal(tmp_path, cache):
    text = tmp_path / "a.txt"
    text.write_text("one paragraph of text\n\nand a second one, a little longer\n")
    first = load_packed_windows([text], 7)
    assert len(list(cache.glob("*.npy"))) == 1
    build, built = _counting(np.zeros((1, 8), dtype=np.int64))
    again = cached_windows([text], 8, ByteTokenizer(), build)
    assert built == [] and np.array_equal(again, first) and again.dtype == np.int64


@pytest.mark.parametrize("change", ["text", "window", "corrupt"])
def test_another_text_window_or_a_damaged_file_is_built_again(tmp_path, cache, change):
    text = tmp_path / "a.txt"
    text.write_text("some text to pack into windows of eight tokens\n")
    windows = load_packed_windows([text], 7)
    if change == "text":
        text.write_text("other text to pack into windows of eight tokens\n")
    elif change == "corrupt":
        next(cache.glob("*.npy")).write_bytes(b"not an array")
    window = 9 if change == "window" else 8
    build, built = _counting(np.ones((2, window), dtype=np.int64))
    got = cached_windows([text], window, ByteTokenizer(), build)
    assert built == [1] and np.array_equal(got, np.ones((2, window))) and not np.array_equal(got[:1], windows[:1])


def test_with_the_cache_off_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_CACHE_ENV, "off")
    build, built = _counting(np.ones((1, 4), dtype=np.int64))
    for _ in range(2):
        cached_windows([], 4, ByteTokenizer(), build)
    assert built == [1, 1] and not list(tmp_path.rglob("*.npy"))


def test_a_cache_that_cannot_be_written_is_passed_over(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    monkeypatch.setenv(DATA_CACHE_ENV, str(blocker / "cache"))
    build, built = _counting(np.ones((1, 4), dtype=np.int64))
    assert np.array_equal(cached_windows([], 4, ByteTokenizer(), build), np.ones((1, 4))) and built == [1]

"""Training data for the CPU trainer: a byte-level tokenizer and packed windows from local text files.

No hub and no download: the tokenizer is the 256 byte values plus a few special ids, and the text comes from
files on disk — by default the corpus bundled in ``nanotron_ext/data/`` (about 150 KB of simple English,
written and generated for this project). Files are read with ``datasets.load_dataset("text", ...)`` one
paragraph per row, tokenised (bytes, then ``EOS`` after each paragraph), concatenated and cut into windows of
``sequence_length + 1`` tokens (inputs are ``window[:-1]``, labels ``window[1:]``); the packed windows are kept
between runs (:mod:`nanotron_ext.runtime.data_cache`).

Order is deterministic given a seed: epoch ``e`` visits the windows in ``permutation(seed, e)`` and DP rank
``r`` of ``d`` takes every ``d``-th window of that order starting at ``r``, so DP replicas see disjoint data
and every PP/TP rank of one replica sees the same batches.

In the Nanotron YAML, ``data.dataset.hf_dataset_or_datasets`` may name a local ``.txt`` file, a folder of
``.txt`` files, or a list of them (relative paths are looked up from the working directory, then from the
YAML's folder); ``data.dataset: null`` uses the bundled corpus.

Tests, benchmarks and the memory measurement train on random tokens instead: :func:`random_token_batches` /
:func:`random_micro_batches`, the one seeded stream they share (identical on every rank for a seed).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from nanotron_ext.errors import ConfigError
from nanotron_ext.runtime.data_cache import cached_windows

__all__ = [
    "ByteTokenizer",
    "PackedTextData",
    "bundled_corpus",
    "data_files_from_config",
    "load_packed_windows",
    "random_micro_batches",
    "random_token_batches",
]

DATA_KEY = "data.dataset.hf_dataset_or_datasets"


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes of UTF-8 text as token ids ``0..255``, plus ``bos``/``eos``/``pad`` ids right after them.

    The model's vocabulary may be larger (ids above ``vocab_size`` are simply never produced).
    """

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        """Smallest model vocabulary that can hold every id this tokenizer produces."""
        return max(self.bos_id, self.eos_id, self.pad_id) + 1

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), optionally framed by ``bos``/``eos``."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of byte ids; special ids are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def check_model_vocab(self, model_vocab_size: int) -> None:
        """Raise if the model cannot embed every id this tokenizer produces.

        Raises:
            ConfigError: ``model_vocab_size`` is smaller than :attr:`vocab_size`.
        """
        if model_vocab_size < self.vocab_size:
            raise ConfigError(
                f"model_config.vocab_size={model_vocab_size} is smaller than the byte tokenizer's "
                f"{self.vocab_size} ids (256 bytes + bos/eos/pad); set vocab_size >= {self.vocab_size}"
            )


def bundled_corpus() -> Path:
    """The text corpus shipped in ``nanotron_ext/data/``."""
    return Path(str(resources.files("nanotron_ext") / "data" / "tiny_corpus.txt"))


def data_files_from_config(nanotron: dict[str, Any], *, config_path: str | Path | None = None) -> list[Path]:
    """The text files a Nanotron YAML asks for (``data.dataset.hf_dataset_or_datasets``).

    Args:
        nanotron: the YAML as a dict (``PlannerConfig.nanotron``).
        config_path: the YAML's path; relative data paths are also looked up next to it.

    Returns:
        Existing files, sorted within each folder; the bundled corpus when ``data.dataset`` is null.

    Raises:
        ConfigError: a path that does not exist (names it and where it was looked up), a folder without
            ``.txt`` files, or a value that is not a path (hub names and dataset mixtures are not supported).
    """
    data = nanotron.get("data") or {}
    dataset = data.get("dataset") if isinstance(data, dict) else None
    if dataset is None:
        return [bundled_corpus()]
    if not isinstance(dataset, dict):
        raise ConfigError(f"'data.dataset' must be a mapping or null, got {type(dataset).__name__}")
    value = dataset.get("hf_dataset_or_datasets")
    if value is None:
        return [bundled_corpus()]
    if isinstance(value, str):
        entries = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        entries = list(value)
    else:
        raise ConfigError(
            f"'{DATA_KEY}' = {value!r}: the CPU trainer reads local text files only; give a path (or a list of "
            "paths) to .txt files or folders of them, or set 'data.dataset: null' to use the bundled corpus"
        )
    base = Path(config_path).resolve().parent if config_path is not None else None
    files: list[Path] = []
    for entry in entries:
        files += _expand(entry, base)
    return files


def _expand(entry: str, base: Path | None) -> list[Path]:
    raw = Path(entry).expanduser()
    candidates = [raw] if raw.is_absolute() else [Path.cwd() / raw] + ([base / raw] if base is not None else [])
    for path in candidates:
        if path.is_file():
            return [path]
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".txt")
            if not found:
                raise ConfigError(f"data folder '{path}' (from '{DATA_KEY}') holds no .txt file; add some text")
            return found
    where = " or ".join(f"'{p}'" for p in candidates)
    raise ConfigError(
        f"data file '{entry}' (from '{DATA_KEY}') does not exist: looked for {where}. The CPU trainer reads "
        "local text files only (no hub): point it at a .txt file or a folder of .txt files, or set "
        "'data.dataset: null' to train on the bundled corpus"
    )


def load_packed_windows(
    files: Sequence[str | Path], sequence_length: int, tokenizer: ByteTokenizer | None = None
) -> np.ndarray:
    """Every ``sequence_length + 1`` window of the tokenised, concatenated files, in file order.

    Args:
        files: text files (read with ``datasets.load_dataset("text", sample_by="paragraph")``).
        sequence_length: model sequence length; windows hold one more token (the last label).
        tokenizer: defaults to :class:`ByteTokenizer`.

    Returns:
        ``int64`` array ``[n_windows, sequence_length + 1]``; the tail shorter than a window is dropped.

    Raises:
        ConfigError: the files are empty or too small for one window.
    """
    tokenizer = tokenizer or ByteTokenizer()
    window = sequence_length + 1
    _check_text_files(files)
    if all(Path(f).stat().st_size == 0 for f in files):  # datasets cannot even infer a schema from them
        raise _too_little_text(files, window)
    return cached_windows(files, window, tokenizer, lambda: _pack(files, window, tokenizer))


def _pack(files: Sequence[str | Path], window: int, tokenizer: ByteTokenizer) -> np.ndarray:
    """The windows of :func:`load_packed_windows`, read with ``datasets`` and packed."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # A private cache folder per process: no lock contention between ranks, nothing left behind.
    cache = tempfile.mkdtemp(prefix="nanotron_ext_data_")
    try:
        text = datasets.load_dataset(
            "text",
            data_files=[str(f) for f in files],
            split="train",
            sample_by="paragraph",
            keep_linebreaks=True,
            cache_dir=cache,
            keep_in_memory=True,
        )

        def pack(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            ids = [i for t in batch["text"] if t.strip() for i in tokenizer.encode(t.strip("\n"), add_eos=True)]
            n = len(ids) // window
            return {"input_ids": [ids[k * window : (k + 1) * window] for k in range(n)]}

        # One batch over the whole corpus: packing across paragraph boundaries, deterministic, no remainder
        # dropped per batch (the corpus is small).
        packed = text.map(pack, batched=True, batch_size=None, remove_columns=text.column_names, keep_in_memory=True)
        # Text shorter than one window packs to no row at all, and then datasets drops the column too.
        rows = packed["input_ids"] if "input_ids" in packed.column_names else []
        windows = np.asarray(rows, dtype=np.int64).reshape(-1, window)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if len(windows) == 0:
        raise _too_little_text(files, window)
    return windows


def _check_text_files(files: Sequence[str | Path]) -> None:
    """Each data file is readable UTF-8 text (datasets would fail on it with "An error occurred while
    generating the dataset").

    Raises:
        ConfigError: naming the file that cannot be read, is binary or is not UTF-8, and the fix.
    """
    for f in files:
        try:
            data = Path(f).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"data file '{f}' cannot be read ({exc.strerror or exc}); check the path and its permissions"
            ) from None
        if b"\x00" in data:
            raise ConfigError(
                f"data file '{f}' is binary (it holds NUL bytes), not text; point "
                f"data.dataset.hf_dataset_or_datasets at UTF-8 .txt files"
            )
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"data file '{f}' is not UTF-8 text (byte {exc.start}); convert it to UTF-8 or "
                f"point data.dataset.hf_dataset_or_datasets at UTF-8 .txt files"
            ) from None


def _too_little_text(files: Sequence[str | Path], window: int) -> ConfigError:
    return ConfigError(
        f"the data files ({', '.join(str(f) for f in files)}) hold fewer than {window} tokens "
        f"(sequence_length + 1); give more text"
    )


class PackedTextData:
    """This DP rank's endless stream of ``(input_ids, label_ids)`` micro-batches over packed windows.

    Args:
        windows: ``[n, sequence_length + 1]`` token windows (:func:`load_packed_windows`), same on every rank.
        micro_batch_size: sequences per micro-batch.
        dp_rank: this replica's data-parallel rank.
        dp_size: number of data-parallel replicas.
        seed: order of the windows (same on every rank).

    Raises:
        ConfigError: fewer windows per replica than one micro-batch needs.
        ValueError: ``dp_rank`` outside ``[0, dp_size)``.
    """

    def __init__(
        self, windows: np.ndarray, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_size})")
        self.windows = windows
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        # Equal shards, so every replica's epochs end on the same step.
        self.windows_per_rank = len(windows) // dp_size
        if self.windows_per_rank < micro_batch_size:
            raise ConfigError(
                f"the data has {len(windows)} windows of {windows.shape[1]} tokens: fewer than "
                f"micro_batch_size={micro_batch_size} per DP replica (dp={dp_size}); give more text or shrink "
                "the batch"
            )

    def shard_indices(self, epoch: int) -> np.ndarray:
        """Window indices this rank visits in ``epoch``, in order."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        return order[self.dp_rank :: self.dp_size][: self.windows_per_rank]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """Endless ``(input_ids, label_ids)`` pairs of ``torch.long`` tensors ``[micro_batch_size, seq]``."""
        import torch

        epoch, b = 0, self.micro_batch_size
        while True:
            idx = self.shard_indices(epoch)
            for start in range(0, len(idx) - b + 1, b):
                batch = torch.from_numpy(self.windows[idx[start : start + b]])
                yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            epoch += 1


def random_token_batches(
    vocab_size: int, micro_batch_size: int, sequence_length: int, seed: int = 0, *, pool: int | None = None
) -> Iterator[Any]:
    """Endless random ``[micro_batch_size, sequence_length + 1]`` ``torch.long`` token windows, uniform in
    ``[0, vocab_size)``: the same sequence on every rank for a given ``seed`` (a private generator; the global
    torch seed is left alone).

    Args:
        vocab_size: token ids are drawn below it (a small range gives a tiny model something learnable).
        micro_batch_size: rows per window batch.
        sequence_length: model sequence length; windows hold one more token (inputs ``[:, :-1]``, labels
            ``[:, 1:]``).
        seed: the generator's seed.
        pool: draw only this many batches and cycle through them (a small fixed data set, so that losses fall);
            None draws a fresh batch every time. Cycled batches are the same tensors: do not modify them.

    Raises:
        ValueError: a size or ``pool`` below 1.
    """
    import torch

    for name, value in (
        ("vocab_size", vocab_size),
        ("micro_batch_size", micro_batch_size),
        ("sequence_length", sequence_length),
        ("pool", 1 if pool is None else pool),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    generator = torch.Generator().manual_seed(seed)

    def draw() -> Any:
        return torch.randint(0, vocab_size, (micro_batch_size, sequence_length + 1), generator=generator)

    if pool is None:
        while True:
            yield draw()
    batches = [draw() for _ in range(pool)]
    while True:
        yield from batches


def random_micro_batches(
    model: Any,
    parallel_context: Any,
    vocab_size: int,
    micro_batch_size: int,
    sequence_length: int,
    seed: int = 0,
    *,
    pool: int | None = None,
) -> Iterator[Any]:
    """:func:`random_token_batches` as the engine's micro-batches (``nanotron_ext.runtime.engine.make_micro_batch``:
    inputs on the model's input rank, labels where the loss is computed, ``TensorPointer``s elsewhere)."""
    from nanotron_ext.runtime.engine import make_micro_batch

    for tokens in random_token_batches(vocab_size, micro_batch_size, sequence_length, seed, pool=pool):
        yield make_micro_batch(model, parallel_context, input_ids=tokens[:, :-1], label_ids=tokens[:, 1:])

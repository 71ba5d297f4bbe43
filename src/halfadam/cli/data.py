"""Data for ``halfadam train``: a character corpus (text file or the Python standard library) and digits.

Every dataset here is deterministic: the same arguments give the same tokens, the same train/validation
split and, for a given seed, the same sequence of training batches. The training loop draws the batch
plan once (:meth:`sample_plan`) and feeds exactly the same batches to every mode.
"""

from __future__ import annotations

import os
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CLIError

__all__ = ["CharCorpus", "DigitsData", "load_char_corpus", "load_digits_data", "read_text_file", "stdlib_sources"]

#: Directories skipped when collecting standard-library sources: installed packages and test suites.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

#: Every ``VAL_EVERY``-th chunk of the text is held out for validation.
VAL_EVERY = 10
_N_CHUNKS = 100


def stdlib_sources(max_chars: int) -> tuple[list[Path], str]:
    """Collect the standard library's own ``.py`` sources, deterministically, up to ``max_chars`` characters.

    The directory comes from ``sysconfig.get_paths()["stdlib"]``. Files are visited in sorted order
    (top-level modules first, then packages), skipping installed packages and test suites, and taken
    whole until adding the next one would exceed ``max_chars``. Files that are not valid UTF-8 are
    skipped. Returns the files used and their concatenated text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CLIError(f"cannot find the Python standard library at {root}; pass --text PATH instead")
    files: list[Path] = []
    parts: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if total + len(text) > max_chars:
                if files:
                    return files, "".join(parts)
                continue
            files.append(path)
            parts.append(text)
            total += len(text)
    if not files:
        raise CLIError(f"found no readable .py files under {root}; pass --text PATH instead")
    return files, "".join(parts)


@dataclass
class CharCorpus:
    """A character-level corpus split into train and validation token streams.

    ``vocab`` lists the characters; index ``len(vocab)`` (if ``has_unk``) stands for characters outside
    the vocabulary. Validation windows are fixed: ``val_x``/``val_y`` hold up to ``eval_sequences``
    windows of ``seq_len`` tokens spread evenly over the held-out text.
    """

    source: str
    vocab: list[str]
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    seq_len: int
    val_x: torch.Tensor = field(repr=False)
    val_y: torch.Tensor = field(repr=False)
    info: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the vocabulary plus one id for unknown characters)."""
        return len(self.vocab) + 1

    def sample_plan(self, steps: int, batch_size: int, seed: int) -> torch.Tensor:
        """Window start offsets into the training tokens for every step: a ``(steps, batch_size)`` tensor.

        A longer plan begins with the shorter one (``--resume`` extends runs on that).
        """
        gen = torch.Generator().manual_seed(seed)
        high = len(self.train_tokens) - self.seq_len
        return torch.randint(0, high, (steps, batch_size), generator=gen)

    def batch(self, starts: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets for windows starting at ``starts``."""
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        chunk = self.train_tokens[idx]
        return chunk[:, :-1].to(device), chunk[:, 1:].to(device)

    def val_batches(self, batch_size: int, device: torch.device):
        """The fixed validation set, in batches of ``batch_size`` sequences."""
        for i in range(0, len(self.val_x), batch_size):
            yield self.val_x[i : i + batch_size].to(device), self.val_y[i : i + batch_size].to(device)


def _encode(text: str, stoi: dict[str, int], unk: int) -> torch.Tensor:
    return torch.tensor([stoi.get(c, unk) for c in text], dtype=torch.long)


def _split(text: str, min_chunk: int) -> tuple[str, str]:
    """Cut the text into about 100 contiguous chunks; every 10th goes to validation."""
    chunk = max(-(-len(text) // _N_CHUNKS), min_chunk)
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    if len(pieces) < VAL_EVERY:  # short text: hold out the last tenth
        cut = len(text) - max(len(text) // VAL_EVERY, min_chunk)
        return text[:cut], text[cut:]
    train = "".join(p for i, p in enumerate(pieces) if i % VAL_EVERY != VAL_EVERY - 1)
    val = "".join(p for i, p in enumerate(pieces) if i % VAL_EVERY == VAL_EVERY - 1)
    return train, val


def read_text_file(text_path: str, max_chars: int = 2_000_000) -> str:
    """The first ``max_chars`` characters of the ``--text`` file (undecodable bytes replaced); CLIError when
    it is missing, not a file or unreadable. ``halfadam train`` also calls it before it creates anything."""
    path = Path(text_path)
    if not path.exists():
        raise CLIError(f"text file not found: {text_path}")
    if not path.is_file():
        raise CLIError(f"--text {text_path} is not a file")
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.read(max_chars)  # the first max_chars characters are plenty
    except OSError as exc:
        raise CLIError(f"cannot read text file {text_path}: {exc.strerror or exc}") from None


def load_char_corpus(
    text_path: str | None,
    seq_len: int,
    *,
    max_chars: int = 2_000_000,
    max_vocab: int = 255,
    eval_sequences: int = 128,
) -> CharCorpus:
    """Load a character corpus from ``text_path`` or, when it is ``None``, from the standard library.

    The vocabulary keeps the ``max_vocab`` most frequent characters (ties broken by character); the rest
    map to one unknown id. The text is split into train/validation deterministically (see ``_split``).
    Raises :class:`CLIError` when the file is missing, unreadable or too short for ``seq_len``.
    """
    if text_path is None:
        files, text = stdlib_sources(max_chars)
        root = Path(sysconfig.get_paths()["stdlib"])
        source = f"Python standard library sources ({len(files)} files under {root})"
        info = {
            "source": "stdlib",
            "stdlib_dir": str(root),
            "files": len(files),
            "first_file": str(files[0].relative_to(root)),
            "last_file": str(files[-1].relative_to(root)),
        }
    else:
        path = Path(text_path)
        text = read_text_file(text_path, max_chars)
        source = str(path)
        info = {"source": "file", "path": str(path.resolve())}

    min_len = 2 * (seq_len + 1) * VAL_EVERY
    if len(text) < min_len:
        raise CLIError(
            f"text is too short: {len(text)} characters, need at least {min_len} for --seq-len {seq_len}"
        )
    counts = Counter(text)
    vocab = sorted(sorted(counts), key=lambda c: -counts[c])[:max_vocab]
    vocab.sort()
    stoi = {c: i for i, c in enumerate(vocab)}
    unk = len(vocab)

    train_text, val_text = _split(text, seq_len + 1)
    train_tokens = _encode(train_text, stoi, unk)
    val_tokens = _encode(val_text, stoi, unk)

    n_windows = len(val_tokens) // (seq_len + 1)
    n_eval = min(eval_sequences, n_windows)
    starts = torch.linspace(0, len(val_tokens) - seq_len - 1, n_eval).long()
    idx = starts[:, None] + torch.arange(seq_len + 1)
    windows = val_tokens[idx]
    info.update(
        characters=len(text),
        train_characters=len(train_tokens),
        val_characters=len(val_tokens),
        vocab_size=len(vocab) + 1,
        eval_sequences=n_eval,
    )
    return CharCorpus(
        source=source,
        vocab=vocab,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        seq_len=seq_len,
        val_x=windows[:, :-1].contiguous(),
        val_y=windows[:, 1:].contiguous(),
        info=info,
    )


@dataclass
class DigitsData:
    """scikit-learn's 8x8 digits, pixels scaled to [0, 1], split 80/20 with a fixed permutation."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    info: dict = field(default_factory=dict)

    source = "scikit-learn load_digits (8x8 images, 10 classes)"
    num_features = 64
    num_classes = 10

    def sample_plan(self, steps: int, batch_size: int, seed: int) -> torch.Tensor:
        """Training example indices for every step: a ``(steps, batch_size)`` tensor.

        A longer plan begins with the shorter one (``--resume`` extends runs on that).
        """
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, len(self.train_x), (steps, batch_size), generator=gen)

    def batch(self, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and labels at ``idx``."""
        return self.train_x[idx].to(device), self.train_y[idx].to(device)

    def val_batches(self, batch_size: int, device: torch.device):
        """The fixed validation set, in batches of ``batch_size`` examples."""
        for i in range(0, len(self.val_x), batch_size):
            yield self.val_x[i : i + batch_size].to(device), self.val_y[i : i + batch_size].to(device)


def load_digits_data() -> DigitsData:
    """Load scikit-learn's digits (bundled with scikit-learn, no download). Raises :class:`CLIError`
    with an install hint when scikit-learn is missing."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise CLIError(
            "--task digits needs scikit-learn: pip install scikit-learn (or halfadam[digits])"
        ) from None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    return DigitsData(
        train_x=x[train],
        train_y=y[train],
        val_x=x[val],
        val_y=y[val],
        info={"source": "sklearn.load_digits", "train_examples": len(train), "val_examples": n_val},
    )

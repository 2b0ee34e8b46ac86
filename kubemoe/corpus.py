"""Text already on the machine, for training the project's own MoE: the Python standard library.

Its sources and the documentation it ships (`pydoc_data/topics.py` holds the language reference's
text) are on every machine that runs kubemoe, so training never downloads anything. Files are read
in an order fixed by a hash of their path and split into training and held-out text by a hash of their path, so the same
Python version always gives the same corpus; `fingerprint` names it in training metadata (the lent
GPU machine's Python is another version, so its corpus differs: the fingerprint says so).
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_BUCKETS = 10  # one file in ten (by path hash) is held out


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # one text per file
    held_out: list[str]
    fingerprint: str  # sha256 over paths and contents, first 16 hex digits

    @property
    def chars(self) -> int:
        return sum(map(len, self.train)) + sum(map(len, self.held_out))


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The library's .py files ordered by a hash of their path: a prefix is a sample of every package."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: (_bucket(p.relative_to(root)), p.relative_to(root).as_posix()))


def _bucket(rel: Path) -> int:
    return zlib.crc32(rel.as_posix().encode())


def stdlib_corpus(max_chars: int | None = None, root: Path | None = None) -> Corpus:
    """The standard library's text, at most `max_chars` of it (whole files, in `stdlib_files` order)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train: list[str] = []
    held_out: list[str] = []
    digest, total = hashlib.sha256(), 0
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        if max_chars is not None and total + len(text) > max_chars:
            if total:
                break
            text = text[:max_chars]
        total += len(text)
        digest.update(rel.encode() + b"\0" + text.encode())
        (held_out if _bucket(path.relative_to(root)) % HELD_OUT_BUCKETS == 0 else train).append(text)
    if not train or not held_out:
        raise ValueError(f"the standard library at {root} gave too little text ({total} characters) to train on")
    return Corpus(train, held_out, digest.hexdigest()[:16])

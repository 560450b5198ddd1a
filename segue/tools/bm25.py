"""A small Okapi BM25 index over paragraphs of local text files, for the `search` builtin.

Written here rather than pulled in as a dependency: it is a few dozen lines, the corpora it serves
are demo-sized, and it keeps the tool layer free of numpy-at-import and extra packages.
"""
from __future__ import annotations

import collections
import math
import pathlib
import re
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
CORPUS_SUFFIXES = (".txt", ".md")


def tokenize(text: str) -> list[str]:
    return [t.lower() for t in _TOKEN_RE.findall(text)]


@dataclass(frozen=True)
class Passage:
    source: str  # file name relative to the corpus directory
    text: str


@dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float


def load_passages(directory: str | pathlib.Path) -> list[Passage]:
    """One passage per blank-line separated paragraph of every .txt/.md file, in a stable order."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {str(root)!r} does not exist")
    passages: list[Passage] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES):
        text = path.read_text(encoding="utf-8", errors="replace")
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            # Markdown headings alone carry too few words to be a useful answer.
            if para and not (para.startswith("#") and len(para.split()) < 8):
                passages.append(Passage(path.relative_to(root).as_posix(), para))
    return passages


class BM25Index:
    """Okapi BM25 (k1, b) with the non-negative idf variant, so common terms never score below 0."""

    def __init__(self, passages: list[Passage], k1: float = 1.5, b: float = 0.75) -> None:
        self.passages = passages
        self.k1, self.b = k1, b
        self._tfs = [collections.Counter(tokenize(p.text)) for p in passages]
        self._lengths = [sum(tf.values()) for tf in self._tfs]
        self._avg_len = (sum(self._lengths) / len(self._lengths)) if self._lengths else 0.0
        df: collections.Counter[str] = collections.Counter()
        for tf in self._tfs:
            df.update(tf.keys())
        n = len(passages)
        self._idf = {term: math.log((n - d + 0.5) / (d + 0.5) + 1.0) for term, d in df.items()}

    def search(self, query: str, k: int = 3) -> list[Hit]:
        terms = set(tokenize(query)) & self._idf.keys()
        if not terms or k < 1:
            return []
        hits = []
        for i, tf in enumerate(self._tfs):
            norm = self.k1 * (1.0 - self.b + self.b * self._lengths[i] / self._avg_len)
            score = sum(self._idf[t] * tf[t] * (self.k1 + 1.0) / (tf[t] + norm) for t in terms if t in tf)
            if score > 0:
                hits.append(Hit(self.passages[i], score))
        # Ties keep corpus order, so results are deterministic across runs.
        hits.sort(key=lambda h: -h.score)
        return hits[:k]

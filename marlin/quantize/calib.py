"""Calibration samples: token windows drawn from a text with a fixed seed.

The paper's variant calibrates on samples of *varying* length: a model sees short and long
contexts, and the Hessians should too. Each sample is a window of the tokenized calibration text,
its length drawn uniformly from [min, max] and its start uniformly from the text, and is run on its
own (batch 1), so no token is padding. The fixed-length option draws every window with the same
length, as standard GPTQ does (e.g. 128 x 2048 tokens of C4), for comparison.

Both are reproducible: the same text, counts and seed give the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

__all__ = ["CalibrationSpec", "read_texts", "draw_samples", "parse_seqlen_range"]

TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class CalibrationSpec:
    """How many windows and of which lengths (min == max: fixed length)."""

    nsamples: int = 256
    min_len: int = 32
    max_len: int = 512
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.nsamples, int) or self.nsamples <= 0:
            raise ValueError(f"nsamples = {self.nsamples!r}, expected a positive integer")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"sequence lengths {self.min_len}:{self.max_len}, expected 1 <= MIN <= MAX")

    @property
    def fixed(self) -> bool:
        return self.min_len == self.max_len


def parse_seqlen_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' or 'LEN' (fixed) -> (min, max)."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"sequence length range {text!r}, expected MIN:MAX or LEN (integers)") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise ValueError(f"sequence length range {text!r}, expected MIN:MAX with 1 <= MIN <= MAX")
    return values[0], values[1]


def read_texts(path: Union[str, Path]) -> str:
    """The text of a file, or of every .txt/.md file of a directory (sorted by name), joined by
    blank lines."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"calibration directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
    else:
        raise ValueError(f"calibration text {path} is neither a file nor a directory")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise ValueError(f"calibration text {f} cannot be read ({e})") from None
    text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"calibration text {path} is empty")
    return text


def draw_samples(token_ids: torch.Tensor, spec: CalibrationSpec) -> list[torch.Tensor]:
    """``spec.nsamples`` windows [1, L] of the 1-D token sequence, lengths in [min_len, max_len]."""
    ids = token_ids.reshape(-1)
    if ids.numel() < spec.max_len + 1:
        raise ValueError(
            f"calibration text has {ids.numel()} tokens, fewer than the longest sample ({spec.max_len}) + 1; "
            "give more text or shorter samples (--seqlen-range)"
        )
    gen = torch.Generator().manual_seed(spec.seed)
    samples = []
    for _ in range(spec.nsamples):
        length = int(torch.randint(spec.min_len, spec.max_len + 1, (1,), generator=gen))
        start = int(torch.randint(0, ids.numel() - length + 1, (1,), generator=gen))
        samples.append(ids[start : start + length].clone().unsqueeze(0))
    return samples

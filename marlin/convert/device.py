"""parse_device: the ``device`` argument of marlin-convert, marlin-quantize and marlin-eval."""

from __future__ import annotations

from typing import Union

import torch

from .errors import ConversionError

__all__ = ["parse_device"]


def parse_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device, if it is the CPU or an available CUDA device.

    Raises ConversionError (a ValueError) naming the value otherwise, so that a bad option fails
    before any model or checkpoint is read.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConversionError(f"device = {device!r} is not a device ({e}); expected 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConversionError(f"device = {device!r}, expected 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"device = {device!r}, but CUDA is not available here; use 'cpu'")
    return dev

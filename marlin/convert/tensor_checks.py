"""Header-level checks of one quantized layer's tensors, shared by the GPTQ, AWQ and
compressed-tensors readers: names present and known, then each tensor's dtype and shape.
Only shapes and dtypes are needed (safetensors headers), no tensor data."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from .errors import ConversionError


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_layer_names(prefix: str, shapes: Mapping[str, tuple], required: Iterable[str], allowed: Iterable[str],
                      what: str = "") -> None:
    """Every ``required`` suffix present and none outside ``allowed``; ``what`` (e.g. "a GPTQ layer")
    adds to the messages what such a layer consists of."""
    required, allowed = tuple(required), tuple(allowed)
    for suffix in required:
        if suffix not in shapes:
            has = f" ({what} has {', '.join(required)})" if what else ""
            raise ConversionError(f"layer {prefix}: {prefix}.{suffix} is missing{has}")
    unknown = sorted(set(shapes) - set(allowed))
    if unknown:
        only = f" next to {prefix}.{required[0]}; {what} has only {', '.join(allowed)}" if what else ""
        raise ConversionError(f"layer {prefix}: unexpected tensor(s) {', '.join(f'{prefix}.{u}' for u in unknown)}{only}")


def tensor_expecter(prefix: str, shapes: Mapping[str, tuple], dtypes: Mapping[str, Any]) -> Callable[..., None]:
    """expect(suffix, dtype_ok, shape, why): if the layer has that tensor, its dtype is one of
    ``dtype_ok`` and its shape is ``shape`` (``why`` says where the expected shape comes from)."""

    def expect(suffix: str, dtype_ok: tuple, shape: tuple, why: str) -> None:
        if suffix not in shapes:
            return
        if dtypes[suffix] not in dtype_ok:
            raise ConversionError(f"{prefix}.{suffix}: dtype {dtypes[suffix]}, expected " + " or ".join(map(str, dtype_ok)))
        if tuple(shapes[suffix]) != tuple(shape):
            raise ConversionError(f"{prefix}.{suffix}: shape {shape_str(shapes[suffix])}, expected {shape_str(shape)} ({why})")

    return expect

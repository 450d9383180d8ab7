"""Reuse a module's output from an earlier pass of the same sample through a block.

True-sequential quantization (marlin.quantize.runner) runs every calibration sample through a
block once per layer group and once more for the block's outputs, and each pass recomputes most
of what the pass before it computed: the input norm in every pass, q/k/v after they were
quantized, the whole attention once o_proj is quantized, gate/up once they are. A module's
forward is a function of its parameters, buffers and inputs, so when none of these changed since
an earlier pass of the same sample, that pass's output *is* the answer, bit for bit, and the
module need not run. On SmolLM2-135M this leaves each Linear computed about once per sample and
block instead of two to three times (benchmarks/NOTES.md, 2026-11-26).

What counts as unchanged, so that a reused output is always the exact one a fresh call gives:
  * the same parameter and buffer objects, with the same version counters (torch bumps a
    tensor's ``_version`` on every in-place change, such as the quantizer's ``weight.copy_``);
  * the same inputs: each tensor argument either the very tensor recorded, unchanged since, or
    bit-for-bit equal to it (same shape, strides, dtype and bits; -0.0 and 0.0 differ); the other
    arguments equal and of the same type; only None, bool, int, float, str, dtype and device are
    compared, any other argument makes the call uncacheable;
  * the recorded output tensors unchanged since (nothing downstream modified them in place).
Modules in training mode, modules with forward hooks on them or on any module inside them (the
Hessian hooks must see every call), and the root module itself always run. With global forward
hooks, or inside inference mode (whose tensors carry no version counter), nothing is reused.

Calls are told apart by (sample, module, n-th call of the module in this pass), so a module that
a block calls several times (a shared activation, say) keeps one entry per call.

Memory: the entries hold every sample's intermediate activations of the block (on SmolLM2-135M
about 36 KB per calibration token, 1.3 GB for 128 samples; a 7B model needs about 6x that per
token). ``max_bytes`` caps what the recorded outputs take; past it, new calls are not recorded
and simply run, which costs time, never correctness.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

__all__ = ["ReplayCache"]

_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device)
# same-size integer views of floating types: comparing bits, so -0.0 != 0.0 and NaN == NaN
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Uncacheable(Exception):
    pass


def _flatten(value: Any, out: list) -> None:
    """Append a flat description of ``value`` to ``out``: tensors as (tensor, version), the
    structure and the scalars as plain tokens. _Uncacheable for anything else."""
    if isinstance(value, torch.Tensor):
        out.append((value, value._version))
    elif isinstance(value, (tuple, list)):
        out.append((type(value), len(value)))
        for v in value:
            _flatten(v, out)
    elif isinstance(value, dict):
        out.append((dict, tuple(value)))
        for v in value.values():
            _flatten(v, out)
    elif isinstance(value, _SCALARS):
        # floats by their bits (hex), so that -0.0 and 0.0 differ; type first, so that 1 != 1.0 != True
        out.append(("scalar", type(value), value.hex() if isinstance(value, float) else value))
    else:
        raise _Uncacheable


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.stride() != b.stride():
        return False
    if a.is_floating_point():
        view = _BITS.get(a.element_size())
        if view is None:
            return False
        return torch.equal(a.view(view), b.view(view))
    if a.is_complex():
        return False
    return torch.equal(a, b)


def _same_inputs(new: list, old: list) -> bool:
    if len(new) != len(old):
        return False
    for x, y in zip(new, old):
        if isinstance(y[0], torch.Tensor):
            if not isinstance(x[0], torch.Tensor):
                return False
            (t, _), (recorded, version) = x, y
            if recorded._version != version:  # changed in place since: nothing trustworthy to compare with
                return False
            if t is not recorded and not _same_bits(t, recorded):
                return False
        elif isinstance(x[0], torch.Tensor) or x != y:
            return False
    return True


def _unchanged(flat: list) -> bool:
    return all(t._version == v for t, v in (e for e in flat if isinstance(e[0], torch.Tensor)))


class _Entry:
    __slots__ = ("state", "inputs", "output", "output_flat", "nbytes")

    def __init__(self, state, inputs, output, output_flat):
        self.state, self.inputs, self.output, self.output_flat = state, inputs, output, output_flat
        self.nbytes = sum(t.numel() * t.element_size() for t, *_ in output_flat if isinstance(t, torch.Tensor))


def _state(module: nn.Module) -> tuple:
    """The module's parameters and buffers with their version counters."""
    tensors = list(module.parameters()) + list(module.buffers())
    return tuple((t, t._version) for t in tensors)


def _same_state(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y and u == v for (x, u), (y, v) in zip(a, b))


class ReplayCache:
    """Outputs of a block's submodules per (sample, module, call), reused while valid (module doc).

    Use: ``with cache.installed(block):`` around the passes, ``cache.begin(i)`` before sample i's
    pass, ``cache.clear()`` when the block is done. ``hits`` and ``misses`` count calls.
    """

    def __init__(self, max_bytes: Optional[int] = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes = {max_bytes}, expected None (no cap) or a size >= 0")
        self.max_bytes = max_bytes
        self._entries: dict = {}
        self._calls: dict = {}
        self._sample: Optional[int] = None
        self.bytes = 0  # what the recorded outputs take (a tensor two entries share counts twice)
        self.hits = 0
        self.misses = 0

    def _forget(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes

    def begin(self, sample: int) -> None:
        """The calls that follow belong to a new pass of ``sample``."""
        self._sample = sample
        self._calls.clear()

    def drop(self, sample: int) -> None:
        """Forget ``sample``'s entries (its last pass is done)."""
        for key in [k for k in self._entries if k[0] == sample]:
            self._forget(key)

    def clear(self) -> None:
        self._entries.clear()
        self._calls.clear()
        self._sample = None
        self.bytes = 0

    @contextlib.contextmanager
    def installed(self, root: nn.Module) -> Iterator[None]:
        """Route the calls of ``root``'s submodules through the cache while the context is open.

        The forward hooks present when it opens decide which modules always run (module doc);
        register the hooks of a pass before opening it.
        """
        module_lib = nn.modules.module
        if torch.is_inference_mode_enabled() or any(
            getattr(module_lib, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
        ):
            yield
            return
        patched = []
        try:
            for _, module in root.named_modules(remove_duplicate=True):
                if module is root or module.training or any(m._forward_hooks or m._forward_pre_hooks for m in module.modules()):
                    continue
                own = module.__dict__.get("forward")  # an instance-level forward (e.g. accelerate's hooks) stays under ours
                module.forward = self._wrap(module, module.forward)
                patched.append((module, own))
            yield
        finally:
            for module, own in patched:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _wrap(self, module: nn.Module, forward):
        def cached_forward(*args, **kwargs):
            if self._sample is None:
                return forward(*args, **kwargs)
            call = self._calls.get(id(module), 0)
            self._calls[id(module)] = call + 1
            key = (self._sample, id(module), call)
            try:
                inputs: list = []
                _flatten((args, kwargs), inputs)
            except _Uncacheable:
                self.misses += 1
                return forward(*args, **kwargs)
            state = _state(module)
            entry = self._entries.get(key)
            if (
                entry is not None
                and _same_state(state, entry.state)
                and _unchanged(entry.output_flat)
                and _same_inputs(inputs, entry.inputs)
            ):
                self.hits += 1
                return entry.output
            self.misses += 1
            output = forward(*args, **kwargs)
            self._forget(key)
            try:
                output_flat: list = []
                _flatten(output, output_flat)
            except _Uncacheable:
                return output
            new = _Entry(state, inputs, output, output_flat)
            if self.max_bytes is None or self.bytes + new.nbytes <= self.max_bytes:
                self._entries[key] = new
                self.bytes += new.nbytes
            return output

        return cached_forward

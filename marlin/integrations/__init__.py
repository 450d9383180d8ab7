"""Integrations of marlin with other libraries (today: Hugging Face transformers).

``import marlin`` must stay cheap, and transformers' quantizer machinery costs seconds to import
(a user who only wants a tokenizer should not pay it), so the transformers integration
(marlin.integrations.hf_quantizer) is registered lazily: right away if ``transformers.quantizers``
is already imported, otherwise by a one-shot import hook the moment it is (from_pretrained
imports it through transformers.modeling_utils). After that,
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads checkpoints whose config.json says ``quantization_config.quant_method = "marlin"`` (what marlin-convert writes).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

__all__ = ["register_transformers", "install_transformers_hook", "mark_marlin_config"]

log = logging.getLogger(__name__)

_WATCHED = "transformers.quantizers"  # holds the registration API; imported by modeling_utils


def register_transformers() -> bool:
    """Register marlin's quantization config and quantizer with transformers (idempotent).

    Returns True when marlin's quantizer is registered, False when transformers is not installed
    (or too old for the registration API), or another "marlin" quantizer was registered first
    (logged as a warning). The module hf_quantizer registers itself when it is imported, so this
    also works when the hook fires while that module is itself importing transformers.
    """
    try:
        from . import hf_quantizer
    except ImportError as e:
        log.debug("marlin: transformers integration not registered: %s", e)
        return False
    return getattr(hf_quantizer, "registered", False)  # False only while hf_quantizer is mid-import


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.quantizers`` is about to be imported, it lets the
    other finders locate it and wraps the loader so that marlin registers once the package has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _WATCHED:
            return None
        _remove_hook()  # one shot; also keeps the search below from finding this finder again
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module):
            exec_module(module)
            try:
                register_transformers()
            except Exception as e:  # never break the user's import of transformers
                log.warning("marlin: could not register the transformers integration: %r", e)

        loader.exec_module = exec_then_register  # this loader instance belongs to this spec only
        return spec


_hook = _RegisterAfterImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def install_transformers_hook() -> None:
    """Register with transformers now if its quantizers are imported, else when they are (see the
    module doc)."""
    if _WATCHED in sys.modules:
        register_transformers()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def mark_marlin_config(model, **fields) -> bool:
    """Give a transformers model whose layers marlin.replace_linear just replaced a
    ``quantization_config`` with quant_method "marlin" (a plain dict: no transformers import),
    unless its config already has one. Without it, save_pretrained writes the Marlin tensors under
    a plain config, and from_pretrained of that directory builds nn.Linear layers, finds none of
    their weights and initializes them at random (transformers only reports it). With it, the
    directory loads through marlin's quantizer (and load_quantized). ``fields`` describe the
    quantization (bits, group_size, sym, ...); the loaders read each layer's format from its
    tensors. Returns True when the config was set."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained") or not hasattr(config, "to_dict"):
        return False
    if getattr(config, "quantization_config", None) is not None:
        return False
    config.quantization_config = {"quant_method": "marlin", "checkpoint_format": "marlin", "desc_act": False,
                                  **fields}
    return True

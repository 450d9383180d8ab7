"""Loading the model to quantize or evaluate: a transformers causal LM from safetensors or GGUF.

Accepted: a Hugging Face model directory with config.json and safetensors weights, a directory
with one .gguf file (or the one named by ``gguf_file``), or a path to a .gguf file. GGUF files
are read by transformers' own GGUF loader (needs the ``gguf`` package), which dequantizes them.
Pickle weights (.bin, .pt) are never loaded: they can run code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from ..convert.checkpoint import PICKLE_SUFFIXES

__all__ = ["ModelSource", "resolve_source", "load_model", "load_tokenizer"]


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    gguf_file: Optional[str] = None  # file name inside directory, for GGUF models

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {"use_safetensors": True}

    def describe(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def resolve_source(path: Union[str, Path], gguf_file: Optional[str] = None) -> ModelSource:
    """Check that ``path`` holds a loadable model and say how to load it (ValueError otherwise)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {path} is a file but not a .gguf; give a model directory or a .gguf file")
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise ValueError(f"model {path} does not exist")
    if gguf_file is not None:
        if "/" in gguf_file or not (path / gguf_file).is_file():
            raise ValueError(f"--gguf-file {gguf_file!r} is not a file in {path}")
        return ModelSource(path, gguf_file)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return ModelSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"model directory {path} has several .gguf files {ggufs[:4]}; choose one with --gguf-file")
    pickles = sorted(p.name for p in path.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"model directory {path} has only pickle weights ({', '.join(pickles[:3])}), which are never loaded "
            "(they can run code); re-save the model with safetensors"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json and no .gguf file")
    raise ValueError(f"model directory {path} has a config.json but no *.safetensors weights")


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """The causal LM on the CPU in ``dtype``, in eval mode."""
    import transformers

    from ..hf import _dtype_kwargs

    model = transformers.AutoModelForCausalLM.from_pretrained(
        source.directory, **source.kwargs(), **_dtype_kwargs(dtype), low_cpu_mem_usage=True
    )
    return model.eval()


def load_tokenizer(source: ModelSource):
    import transformers

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return transformers.AutoTokenizer.from_pretrained(source.directory, **kwargs)

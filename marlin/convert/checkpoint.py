"""Reading and writing the safetensors weights of a Hugging Face model directory.

Only safetensors are read: a pickle (.bin, .pt) checkpoint can run arbitrary code when loaded, so
it is refused rather than opened. Shard file names come from the index json and are checked to be
plain file names, so that neither reading nor writing ever leaves the model directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import ConversionError

__all__ = [
    "TensorInfo",
    "SafetensorsDir",
    "PICKLE_SUFFIXES",
    "checked_file_name",
    "read_json",
    "write_json",
    "write_shard",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
INDEX_SUFFIX = ".safetensors.index.json"

# safetensors header dtype names -> torch dtypes (others stay strings and fail every dtype check).
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is and what it is, from the safetensors header (no data read)."""

    file: str
    shape: tuple
    dtype: Union[torch.dtype, str]


def read_json(path: Path) -> Any:
    """Parse a JSON file; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: cannot be read ({e})") from None


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def checked_file_name(name: Any, where: str) -> str:
    """``name`` if it is a plain file name ending in .safetensors, else ConversionError.

    Shard names come from the index json, which is input data: an absolute path, a '..' or a
    directory part could make the converter read or write outside the model directories.
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or Path(name).is_absolute()
        or not name.endswith(".safetensors")
    ):
        raise ConversionError(
            f"{where}: shard file name {name!r} is not a plain file name ending in .safetensors "
            "(absolute paths, directories and '..' are refused)"
        )
    return name


def _refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    found = f"; it has {', '.join(pickles[:3])}" if pickles else ""
    raise ConversionError(
        f"{directory}: no safetensors weights (*.safetensors){found}. Only safetensors checkpoints are read: "
        "pickle files (.bin, .pt) can run arbitrary code when loaded. Re-save the model with "
        "safe_serialization=True (transformers) or convert it with a trusted tool first."
    )


class SafetensorsDir:
    """The safetensors weights of one model directory, with every header opened and validated.

    Finds the shards from ``*.safetensors.index.json`` (weight_map) or a single ``*.safetensors``
    file, checks that the index and the shard headers agree, and knows every tensor's shard,
    shape and dtype. ``get(name)`` reads one tensor. Use as a context manager (closes the files).
    """

    def __init__(self, directory: Union[str, Path]):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConversionError(f"{self.directory}: not a directory")
        self.index_name: Optional[str] = None
        self.index_metadata: dict = {}
        self._handles: dict[str, Any] = {}
        try:
            self.shard_names = self._find_shards()
            self.tensors: dict[str, TensorInfo] = {}
            for shard in self.shard_names:
                self._open_shard(shard)
            if self.index_name is not None:
                self._check_index_matches_headers()
        except BaseException:
            self.close()
            raise

    # -- finding and validating ------------------------------------------------------------
    def _find_shards(self) -> list[str]:
        indexes = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise ConversionError(f"{self.directory}: several safetensors index files {indexes}, expected at most one")
        if indexes:
            self.index_name = indexes[0]
            index = read_json(self.directory / self.index_name)
            where = str(self.directory / self.index_name)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{where}: expected a JSON object with a non-empty 'weight_map' {{tensor: file}}")
            meta = index.get("metadata", {})
            self.index_metadata = meta if isinstance(meta, dict) else {}
            self._weight_map = {}
            for tensor, file in weight_map.items():
                self._weight_map[tensor] = checked_file_name(file, where)
            shards = sorted(set(self._weight_map.values()))
            for shard in shards:
                if not (self.directory / shard).is_file():
                    raise ConversionError(f"{where}: lists shard {shard!r}, which is not a file in {self.directory}")
            return shards
        files = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(".safetensors") and p.is_file())
        if not files:
            _refuse_pickles(self.directory)
        if len(files) > 1:
            raise ConversionError(
                f"{self.directory}: several safetensors files {files[:4]} but no *{INDEX_SUFFIX} saying which tensors "
                "are where; expected one file, or shards with their index"
            )
        return files

    def _open_shard(self, shard: str) -> None:
        path = self.directory / shard
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
            infos = []
            for name in names:
                sl = handle.get_slice(name)
                dtype = sl.get_dtype()
                infos.append((name, TensorInfo(shard, tuple(sl.get_shape()), _DTYPES.get(dtype, dtype))))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ConversionError(f"{path}: not a valid safetensors file ({e}); is it truncated or corrupt?") from None
        self._handles[shard] = handle
        for name, info in infos:
            if name in self.tensors:
                raise ConversionError(f"{path}: tensor {name!r} is also in {self.tensors[name].file}")
            self.tensors[name] = info

    def _check_index_matches_headers(self) -> None:
        where = self.directory / self.index_name
        listed, present = set(self._weight_map), set(self.tensors)
        if listed - present:
            missing = sorted(listed - present)
            name = missing[0]
            raise ConversionError(
                f"{where}: {len(missing)} tensor(s) of weight_map are not in their shard, e.g. {name!r} "
                f"(listed in {self._weight_map[name]})"
            )
        if present - listed:
            extra = sorted(present - listed)
            raise ConversionError(
                f"{where}: {len(extra)} tensor(s) in the shards are not in weight_map, e.g. {extra[0]!r} "
                f"(in {self.tensors[extra[0]].file})"
            )
        for name, file in self._weight_map.items():
            if self.tensors[name].file != file:
                raise ConversionError(
                    f"{where}: weight_map puts {name!r} in {file}, but it is in {self.tensors[name].file}"
                )

    # -- reading ---------------------------------------------------------------------------
    def names_in(self, shard: str) -> list[str]:
        """The tensors of one shard, in header order."""
        return [name for name, info in self.tensors.items() if info.file == shard]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a CPU copy)."""
        info = self.tensors[name]
        try:
            return self._handles[info.file].get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ConversionError(f"{self.directory / info.file}: cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        for handle in self._handles.values():
            try:
                handle.__exit__(None, None, None)
            except Exception:  # pragma: no cover  (closing a read-only mapping cannot lose data)
                pass
        self._handles.clear()

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write one safetensors file (metadata format 'pt', which transformers expects); returns the
    number of bytes of tensor data."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())

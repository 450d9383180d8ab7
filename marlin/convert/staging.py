"""All-or-nothing output: directories and single files written under a temporary name, renamed at the end.

Used by marlin-convert and marlin-quantize (and the benchmarks' result files). A directory
(staged_directory) is written into a hidden sibling of DST; an error (or Ctrl-C) at any point
removes the partial directory, so a failed run leaves neither DST nor a temporary directory
behind. The rename is atomic on one file system; replacing an existing DST (overwrite) takes two
renames, so in the moment between them DST is briefly absent. A single file (replace_file) is
written next to its final name and moved over it with os.replace, so a reader sees the old file
or the new one, never a torn one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import ConversionError

__all__ = ["check_destination", "staged_directory", "replace_file"]


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a DST that overlaps SRC, that exists (unless ``overwrite``), or whose parent is missing."""
    src_real, dst_real = src.resolve(), dst.resolve()
    if _is_within(dst_real, src_real) or _is_within(src_real, dst_real):
        raise ConversionError(
            f"destination {dst} and source {src} overlap; the destination must be a new directory outside the "
            "source (the source is never modified)"
        )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise ConversionError(f"destination {dst} exists; choose a new path or pass overwrite=True (--overwrite)")
        if dst.is_symlink() or not dst.is_dir():
            raise ConversionError(f"destination {dst} exists and is not a directory; refusing to replace it")
    if not dst.parent.is_dir():
        raise ConversionError(f"destination {dst}: its parent directory {dst.parent} does not exist")


def _sibling(dst: Path, tag: str) -> Path:
    return dst.parent / f".{dst.name}.{tag}-{uuid.uuid4().hex[:12]}"


@contextmanager
def staged_directory(dst: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty directory next to ``dst``; on normal exit it becomes ``dst``, on error it is removed."""
    tmp = _sibling(dst, "partial")
    tmp.mkdir()  # exclusive, and with the usual permissions (mkdtemp would make it private)
    try:
        yield tmp
        _commit(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    if not (dst.exists() or dst.is_symlink()):
        os.rename(tmp, dst)
        return
    if not overwrite:  # created by someone else while we converted
        raise ConversionError(f"destination {dst} appeared during the conversion; not replacing it")
    old = _sibling(dst, "old")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` a file next to ``path``, then move it over ``path`` atomically; on error the
    temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

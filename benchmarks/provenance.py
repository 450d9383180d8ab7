"""Provenance of a results file: git revision, the csrc tree hash (computed without git too),
build staleness and device facts, gathered into the results' meta."""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from . import shapes as S
from .bench_math import REPO, sanitize_gpu_name


# ---------------------------------------------------------------------------------------------
# Provenance: git, the csrc tree hash (computed without git too), device facts.
# ---------------------------------------------------------------------------------------------


def _gitignore_patterns(repo: Path) -> list[str]:
    pats = []
    try:
        for line in (repo / ".gitignore").read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and not line.startswith("!"):
                pats.append(line)
    except OSError:
        pass
    return pats


def _ignored(name: str, is_dir: bool, patterns: list[str]) -> bool:
    for pat in patterns:
        dir_only = pat.endswith("/")
        p = pat.rstrip("/")
        if "/" in p:  # anchored / path patterns: only meaningful at the repo root
            continue
        if dir_only and not is_dir:
            continue
        if fnmatch(name, p):
            return True
    return False


def git_tree_hash(path: Path, ignore: Optional[list[str]] = None) -> Optional[str]:
    """The git tree object id of the directory as it is on disk (what ``git write-tree`` would give
    for it once added), so that a copy of the tree without .git can still be compared with
    ``git rev-parse HEAD:csrc``.  None if it holds no files."""
    ignore = _gitignore_patterns(REPO) if ignore is None else ignore
    entries = []
    for entry in os.scandir(path):
        if entry.name == ".git":
            continue
        if entry.is_symlink():
            target = os.readlink(entry.path).encode()
            sha = hashlib.sha1(b"blob %d\0" % len(target) + target).hexdigest()
            entries.append((entry.name, "120000", sha))
        elif entry.is_dir():
            if _ignored(entry.name, True, ignore):
                continue
            sub = git_tree_hash(Path(entry.path), ignore)
            if sub is not None:
                entries.append((entry.name + "/", "40000", sub))
        elif entry.is_file():
            if _ignored(entry.name, False, ignore):
                continue
            data = Path(entry.path).read_bytes()
            sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            mode = "100755" if os.access(entry.path, os.X_OK) else "100644"
            entries.append((entry.name, mode, sha))
    if not entries:
        return None
    entries.sort(key=lambda e: e[0].encode())  # git orders a directory as its name + "/"
    body = b"".join(f"{mode} {name.rstrip('/')}".encode() + b"\0" + bytes.fromhex(sha) for name, mode, sha in entries)
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def _git(*args: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _git_raw(*args: str) -> Optional[str]:
    """Like _git, with the output unstripped."""
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _git_usable() -> bool:
    """git answers for this repository itself (not for a parent folder's repository, nor for an
    empty one: a copy of the tree, as on a device machine, may sit in either) and HEAD exists."""
    top = _git("rev-parse", "--show-toplevel")
    try:
        ours = top is not None and Path(top).resolve() == REPO.resolve()
    except OSError:
        return False
    # a repository without commits (a copied tree that was `git init`ed) cannot say what is committed
    return ours and _git("rev-parse", "--verify", "-q", "HEAD") is not None


def git_info(expect_rev: Optional[str] = None, expect_tree: Optional[str] = None) -> dict:
    """git_rev, csrc_tree (committed), csrc_worktree_tree (on disk), git_dirty and the dirty paths.

    git_dirty: when ``expect_tree`` is given (``--csrc-tree``, e.g. the caller's ``git rev-parse
    HEAD:csrc``), whether the on-disk tree differs from it (a copy may carry an unrelated or stale
    git); otherwise, with git, whether ``git status --porcelain csrc`` lists anything; None when it
    cannot be told."""
    try:
        work = git_tree_hash(REPO / "csrc")
    except OSError:
        work = None
    if expect_tree is not None:
        # given explicitly (a copy whose git, if any, is not the caller's): trust it only as far as
        # the on-disk tree hash matches it
        rev, tree, status, source = expect_rev, expect_tree, None, "given"
    elif _git_usable():
        rev = _git("rev-parse", "HEAD")
        tree = _git("rev-parse", "HEAD:csrc")
        # -z: NUL-separated "XY path" entries, not stripped like _git's text (a leading " M" status
        # would otherwise lose its first column and shift the path)
        status = _git_raw("status", "--porcelain", "-z", "--", "csrc")
        source = "git"
    else:
        rev, tree, status, source = expect_rev, expect_tree, None, "given" if expect_tree else "none"
    if status is not None:
        dirty_files = [entry[3:] for entry in status.split("\0") if len(entry) > 3]
        dirty: Optional[bool] = bool(dirty_files)
    else:
        dirty_files = []
        dirty = (work != tree) if (work is not None and tree is not None) else None
    return {
        "git_rev": rev,
        "csrc_tree": tree,
        "csrc_worktree_tree": work,
        "git_dirty": dirty,
        "git_dirty_files": dirty_files,
        "provenance_source": source,
    }


def build_is_stale() -> Optional[bool]:
    """True if marlin/_C*.so is older than the newest file under csrc/ (a rebuild was forgotten)."""
    try:
        so = max((REPO / "marlin").glob("_C*.so"), key=lambda p: p.stat().st_mtime)
        newest = max(p.stat().st_mtime for p in (REPO / "csrc").rglob("*") if p.is_file())
    except (ValueError, OSError):
        return None
    return so.stat().st_mtime < newest


def dirty_warning(meta: dict) -> Optional[str]:
    if meta.get("git_dirty") is True:
        files = ", ".join(meta.get("git_dirty_files") or []) or "(tree hash differs from HEAD:csrc)"
        return (
            "!" * 100 + "\nWARNING: csrc/ has uncommitted changes: " + files + "\n"
            "These timings come from code that is not committed. Do NOT commit this results file;\n"
            "commit the kernel first, rebuild, and run again.\n" + "!" * 100
        )
    if meta.get("git_dirty") is None:
        return (
            "!" * 100 + "\nWARNING: cannot tell whether csrc/ matches a commit (no git repository here).\n"
            f"csrc/ on disk is tree {meta.get('csrc_worktree_tree')}. Pass --csrc-tree $(git rev-parse HEAD:csrc)\n"
            "(or MARLIN_CSRC_TREE) from the checkout, or let benchmarks.report compare it with your git.\n" + "!" * 100
        )
    return None


def device_facts(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {"gpu": "cpu", "gpu_slug": "cpu", "sms": 0, "l2_bytes": 0, "capability": None, "gpu_mem_bytes": None}
    p = torch.cuda.get_device_properties(dev)
    return {
        "gpu": p.name,
        "gpu_slug": sanitize_gpu_name(p.name),
        "sms": p.multi_processor_count,
        "l2_bytes": int(getattr(p, "L2_cache_size", 0)),
        "capability": f"{p.major}.{p.minor}",
        "gpu_mem_bytes": int(p.total_memory),
        "gpu_uuid": str(getattr(p, "uuid", "")) or None,
    }


def _package_version(name: str) -> Optional[str]:
    """The installed version of a package, without importing it (None when absent)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_meta(dev: torch.device, mode: str, kind: str = "gemm", expect_rev=None, expect_tree=None) -> dict:
    meta = {"kind": kind, "mode": mode}
    meta.update(device_facts(dev))
    meta.update(
        {
            "torch": torch.__version__,
            "transformers": _package_version("transformers"),
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "host": platform.node(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "fp16_reduced_precision_reduction": bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        }
    )
    meta.update(git_info_here(expect_rev, expect_tree))
    meta["build_older_than_csrc"] = build_is_stale()
    return meta


def git_info_here(expect_rev=None, expect_tree=None) -> dict:
    """git_info with the caller's revision and csrc tree taken from MARLIN_GIT_REV / MARLIN_CSRC_TREE
    when not passed: on a copy of the checkout (a GPU machine) whatever git it carries may be stale,
    so the checkout's own values, passed in the environment, win."""
    expect_rev = expect_rev or os.environ.get("MARLIN_GIT_REV") or None
    expect_tree = expect_tree or os.environ.get("MARLIN_CSRC_TREE") or None
    return git_info(expect_rev, expect_tree)

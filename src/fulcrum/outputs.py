"""Output paths probed before long work: a replay, a profiling run or a report that would fail only when it
writes its results fails at once instead, with one line naming the flag, and loses nothing."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["check_writable_file", "check_writable_folder"]


def check_writable_file(path: str | Path, flag: str, *, create_parent: bool = False) -> None:
    """Fail before long work when a file cannot be written at ``path`` (given as ``flag PATH``): a folder of that
    name, a parent that is missing (unless ``create_parent``: then it is created, as the writer would) or not a
    folder, or one that cannot be written into (a read-only file system, ``/proc``). The probe writes and removes
    a scratch file in the parent folder, or opens an existing ``path`` for appending (its content is left as it
    is); nothing it writes stays.

    Raises:
        ValueError: the one-line reason, naming ``flag`` and ``path``.
    """
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, not a file")
    parent = file.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder")
    if not parent.exists():
        if not create_parent:
            raise ValueError(f"{flag} {path}: no such folder {parent}")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot create its folder {parent} ({err.strerror or err})") from None
    try:
        if file.exists():
            with file.open("ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=parent):
                pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None


def check_writable_folder(path: str | Path, flag: str) -> None:
    """Fail before long work unless files can be written into the folder ``path`` (given as ``flag PATH``): it is
    created now (as the writer would create it) and a scratch file is written into it and removed.

    Raises:
        ValueError: ``path`` exists and is not a folder, its parent is not a folder, or it cannot be created or
            written into; the one-line reason, naming ``flag`` and ``path``.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    if folder.parent.exists() and not folder.parent.is_dir():
        raise ValueError(f"{flag} {path}: {folder.parent} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot create the folder ({err.strerror or err})") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write into the folder ({err.strerror or err})") from None

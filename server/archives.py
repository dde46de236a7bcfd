"""Unpacking uploaded training archives (.zip, .tar, .tar.gz) without trusting them.

Refused, each with a message naming the member: absolute paths, `..` components, links, devices and
anything else that is not a plain file or directory, and more unpacked bytes than allowed (counted
while copying, since a zip header's size may lie). Members are written one by one under the
destination; nothing is handed to a library's extract-all.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

COPY_CHUNK = 1 << 20
IGNORED_PREFIXES = ("__MACOSX/",)  # resource forks that macOS's archiver adds


class ArchiveError(ValueError):
    """The archive is unreadable or holds a member we refuse."""


def _safe_parts(name: str) -> tuple[str, ...]:
    normalized = name.replace("\\", "/")
    path = PurePosixPath(normalized)
    if path.is_absolute() or (len(normalized) > 1 and normalized[1] == ":"):
        raise ArchiveError(f"archive member {name!r}: absolute paths are not allowed")
    if ".." in path.parts:
        raise ArchiveError(f"archive member {name!r}: '..' in a path is not allowed")
    return tuple(p for p in path.parts if p not in ("", "."))


class _Budget:
    def __init__(self, max_bytes: int):
        self.left = max_bytes
        self.max_bytes = max_bytes

    def copy(self, src, dst_path: Path, name: str) -> None:
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        with open(dst_path, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                self.left -= len(chunk)
                if self.left < 0:
                    raise ArchiveError(
                        f"archive member {name!r}: the archive unpacks to more than "
                        f"{self.max_bytes} bytes"
                    )
                dst.write(chunk)


def extract_archive(archive: Path, dest: Path, max_bytes: int) -> Path:
    """Unpack `archive` into `dest` and return the dataset root inside it.

    The root is `dest` itself, or the single top-level folder when the archive wraps everything in
    one (as `zip -r data.zip data/` does).
    """
    dest.mkdir(parents=True, exist_ok=True)
    budget = _Budget(max_bytes)
    if zipfile.is_zipfile(archive):
        _extract_zip(archive, dest, budget)
    elif tarfile.is_tarfile(archive):
        _extract_tar(archive, dest, budget)
    else:
        raise ArchiveError("the file is not a .zip, .tar or .tar.gz archive")
    entries = [p for p in dest.iterdir() if not p.name.startswith(".")]
    if not entries:
        raise ArchiveError("the archive is empty")
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return dest


def _extract_zip(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if info.filename.startswith(IGNORED_PREFIXES):
                    continue
                parts = _safe_parts(info.filename)
                # The Unix file type, when a Unix zip wrote one (0 otherwise): refuse links and devices.
                kind = stat.S_IFMT(info.external_attr >> 16)
                if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
                    raise ArchiveError(
                        f"archive member {info.filename!r}: only plain files and folders are allowed"
                    )
                if not parts:
                    continue
                if info.is_dir():
                    dest.joinpath(*parts).mkdir(parents=True, exist_ok=True)
                    continue
                with zf.open(info) as src:
                    budget.copy(src, dest.joinpath(*parts), info.filename)
    except (zipfile.BadZipFile, EOFError) as e:
        raise ArchiveError(f"the zip archive is damaged: {e}") from None


def _extract_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        with tarfile.open(archive, "r:*") as tf:
            for member in tf:
                if member.name.startswith(IGNORED_PREFIXES):
                    continue
                parts = _safe_parts(member.name)
                if member.isdir():
                    if parts:
                        dest.joinpath(*parts).mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    kind = "a link" if member.issym() or member.islnk() else "not a plain file"
                    raise ArchiveError(
                        f"archive member {member.name!r} is {kind}; only plain files and folders "
                        "are allowed"
                    )
                if not parts:
                    continue
                src = tf.extractfile(member)
                budget.copy(src, dest.joinpath(*parts), member.name)
    except (tarfile.TarError, EOFError) as e:
        raise ArchiveError(f"the tar archive is damaged: {e}") from None


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

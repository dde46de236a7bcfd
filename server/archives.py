"""Unpacking uploaded training archives (.zip, .tar, .tar.gz, .tar.bz2, .tar.xz) without trusting
them.

Refused, each with a message naming the member: absolute paths, `..` components, names longer than
a file system takes or nested deeper than a dataset needs, a file and a folder at one path, links,
devices and anything else that is not a plain file or directory, encrypted members, compression
methods we cannot read, damaged data, and more unpacked bytes than allowed (counted while copying,
since a zip header's size may lie). Members are written one by one under the destination; nothing
is handed to a library's extract-all.
"""

from __future__ import annotations

import lzma
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

COPY_CHUNK = 1 << 20
IGNORED_PREFIXES = ("__MACOSX/",)  # resource forks that macOS's archiver adds
MAX_NAME_BYTES = 255  # one path component: NAME_MAX on Linux and macOS
MAX_PATH_BYTES = 1024  # a member's whole path; the unpacked copy must stay under PATH_MAX
MAX_DEPTH = 32  # folders inside folders: far more than any dataset layout needs
# What the parsers and decompressors raise on damaged input: bz2 and gzip raise plain OSError,
# zipfile an OSError when a damaged offset sends it to seek before the start of the file, and a
# UnicodeDecodeError for a name that is not in the encoding its header declares.
DAMAGED = (
    zipfile.BadZipFile,
    tarfile.TarError,
    EOFError,
    OSError,
    zlib.error,
    lzma.LZMAError,
    UnicodeDecodeError,
)


class ArchiveError(ValueError):
    """The archive is unreadable or holds a member we refuse."""


def _safe_parts(name: str) -> tuple[str, ...]:
    normalized = name.replace("\\", "/")
    path = PurePosixPath(normalized)
    if path.is_absolute() or (len(normalized) > 1 and normalized[1] == ":"):
        raise ArchiveError(f"archive member {_shown(name)}: absolute paths are not allowed")
    if ".." in path.parts:
        raise ArchiveError(f"archive member {_shown(name)}: '..' in a path is not allowed")
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES for p in parts):
        raise ArchiveError(
            f"archive member {_shown(name)}: a file or folder name is longer than "
            f"{MAX_NAME_BYTES} bytes"
        )
    if len(normalized.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise ArchiveError(
            f"archive member {_shown(name)}: the path is longer than {MAX_PATH_BYTES} bytes"
        )
    if len(parts) > MAX_DEPTH:
        raise ArchiveError(
            f"archive member {_shown(name)}: nested {len(parts)} levels deep; at most "
            f"{MAX_DEPTH} are allowed"
        )
    return parts


def _shown(name: str) -> str:
    """A member's name for a message: quoted, and cut short when it is long."""
    return repr(name) if len(name) <= 120 else repr(name[:100] + "...")


def _make_dir(path: Path, name: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ArchiveError(
            f"archive member {_shown(name)}: a file and a folder share one path"
        ) from None


class _Budget:
    def __init__(self, max_bytes: int):
        self.left = max_bytes
        self.max_bytes = max_bytes

    def copy(self, src, dst_path: Path, name: str) -> None:
        _make_dir(dst_path.parent, name)
        try:
            dst = open(dst_path, "wb")
        except IsADirectoryError:
            raise ArchiveError(
                f"archive member {_shown(name)}: a file and a folder share one path"
            ) from None
        with dst:
            while chunk := _read(src, name):
                self.left -= len(chunk)
                if self.left < 0:
                    raise ArchiveError(
                        f"archive member {_shown(name)}: the archive unpacks to more than "
                        f"{self.max_bytes} bytes"
                    )
                dst.write(chunk)


def _read(src, name: str) -> bytes:
    """The next chunk of a member; damaged compressed data becomes an ArchiveError naming it."""
    try:
        return src.read(COPY_CHUNK)
    except DAMAGED as e:
        raise ArchiveError(f"archive member {_shown(name)}: its data is damaged ({e})") from None


def extract_archive(archive: Path, dest: Path, max_bytes: int) -> Path:
    """Unpack `archive` into `dest` and return the dataset root inside it.

    The root is `dest` itself, or the single top-level folder when the archive wraps everything in
    one (as `zip -r data.zip data/` does).
    """
    dest.mkdir(parents=True, exist_ok=True)
    budget = _Budget(max_bytes)
    try:
        # Both look at the file's first bytes only; a damaged compressed tar fails them too.
        is_zip, is_tar = zipfile.is_zipfile(archive), tarfile.is_tarfile(archive)
    except DAMAGED as e:
        raise ArchiveError(f"the archive is damaged: {e}") from None
    if is_zip:
        _extract_zip(archive, dest, budget)
    elif is_tar:
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
        zf = zipfile.ZipFile(archive)
    except NotImplementedError as e:  # "zip file version N": a format newer than zipfile reads
        raise ArchiveError(f"the zip archive cannot be read here ({e})") from None
    except DAMAGED as e:
        raise ArchiveError(f"the zip archive is damaged: {e}") from None
    with zf:
        for info in zf.infolist():
            name = info.filename
            if name.startswith(IGNORED_PREFIXES):
                continue
            parts = _safe_parts(name)
            # The Unix file type, when a Unix zip wrote one (0 otherwise): refuse links and devices.
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
                raise ArchiveError(
                    f"archive member {_shown(name)}: only plain files and folders are allowed"
                )
            if not parts:
                continue
            if info.is_dir():
                _make_dir(dest.joinpath(*parts), name)
                continue
            if info.flag_bits & 0x1:  # the zip format's "encrypted" bit
                raise ArchiveError(f"archive member {_shown(name)} is encrypted; upload it plain")
            try:
                src = zf.open(info)
            except NotImplementedError as e:  # a compression method or zip feature unknown here
                raise ArchiveError(
                    f"archive member {_shown(name)} cannot be read here ({e}); store or deflate it"
                ) from None
            except DAMAGED as e:
                raise ArchiveError(f"archive member {_shown(name)} is damaged: {e}") from None
            with src:
                budget.copy(src, dest.joinpath(*parts), name)


def _extract_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        tf = tarfile.open(archive, "r:*")
    except DAMAGED as e:
        raise ArchiveError(f"the tar archive is damaged: {e}") from None
    with tf:
        for member in _tar_members(tf):
            name = member.name
            if name.startswith(IGNORED_PREFIXES):
                continue
            parts = _safe_parts(name)
            if member.isdir():
                if parts:
                    _make_dir(dest.joinpath(*parts), name)
                continue
            if not member.isfile():
                kind = "a link" if member.issym() or member.islnk() else "not a plain file"
                raise ArchiveError(
                    f"archive member {_shown(name)} is {kind}; only plain files and folders "
                    "are allowed"
                )
            if not parts:
                continue
            budget.copy(tf.extractfile(member), dest.joinpath(*parts), name)


def _tar_members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members in order; a damaged header or stream between them becomes an ArchiveError.

    Reading the next header decompresses the data before it, so the errors come from here and
    not only from the members' own reads.
    """
    members = iter(tf)
    while True:
        try:
            member = next(members)
        except StopIteration:
            return
        except DAMAGED as e:
            raise ArchiveError(f"the tar archive is damaged: {e}") from None
        yield member


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

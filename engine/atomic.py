"""Write a file or a directory so that it appears whole or not at all, even across a power cut.

Everything is written under a temporary name beside the target, flushed to disk (fsync), renamed
into place (atomic on POSIX) and the rename itself made durable (fsync of the parent directory).
A failure removes the temporary file or directory at once. Temporary names start with a dot and
end in `.tmp`, so a reader listing the directory can tell them apart and a clean-up can find what
a killed process left. A file's writer holds an advisory lock (flock) on it until it is renamed
into place; the kernel drops the lock when the writer dies, however it dies, so a clean-up can
tell a killed writer's file from a live one's at once, without waiting for it to grow old.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"
FILE_MODE = 0o644  # outputs are world-readable like any other file (mkstemp makes them 0600)
# An unlocked temporary file younger than this may be one whose writer has made it and not yet
# locked it (the two are separate calls), so the clean-up leaves it.
LOCK_GRACE_S = 30.0

# The temporary files this process is writing now. Where flock is emulated with POSIX locks (NFS),
# a lock does not exclude another descriptor of the same process, and closing that descriptor
# would drop the writer's lock: the clean-up never opens these.
_writing: set[str] = set()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename into (or out of) `path` durable, not just the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` to fill a temporary file, then publish it at `path`."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    tmp = Path(name)
    _writing.add(os.path.abspath(name))
    try:
        _lock(fd)  # held until the rename: while it is, `remove_abandoned` leaves the file
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
        _writing.discard(os.path.abspath(name))
    fsync_dir(path.parent)
    return path


def _lock(fd: int) -> None:
    # A file system without locks still takes the write: its clean-up, unable to lock either,
    # then leaves every temporary file to `remove_stale`'s age rule.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, guard: Callable[[], contextlib.AbstractContextManager] | None = None
) -> Iterator[Path]:
    """Yield an empty temporary directory; on a clean exit it replaces `path` whole. `guard()`,
    when given, is a context the renames happen in: it may refuse them by raising (then nothing
    at `path` changes), or hold a lock that keeps others from publishing meanwhile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX))
    try:
        yield tmp
        _fsync_tree(tmp)
        tmp.chmod(0o755)
        with guard() if guard is not None else contextlib.nullcontext():
            if path.exists():
                # Replacing a directory takes two renames; between them the old copy sits under
                # a temporary name, so a crash there leaves no half-written directory at `path`.
                old = path.with_name(f".{path.name}.old{TMP_SUFFIX}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def remove_stale(folder: str | os.PathLike, min_age_s: float = 0.0) -> None:
    """Delete the temporary files and directories a killed process left in `folder`, those last
    modified at least `min_age_s` ago (a live writer elsewhere may own the newer ones)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    cutoff = time.time() - min_age_s
    for item in folder.glob(f".*{TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if item.lstat().st_mtime > cutoff:
                continue
        if item.is_dir():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)


def remove_abandoned(folder: str | os.PathLike, grace_s: float = LOCK_GRACE_S) -> int:
    """Delete the temporary files in `folder` whose writers are gone (killed mid-write) and
    return how many: those no process holds locked (see `atomic_write`), once `grace_s` old.
    A live writer's file stays, on this host or another sharing the folder; directories are
    left to `remove_stale`."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    removed = 0
    for item in folder.glob(f".*{TMP_SUFFIX}"):
        if os.path.abspath(item) not in _writing and _remove_if_unlocked(item, grace_s):
            removed += 1
    return removed


def _remove_if_unlocked(item: Path, grace_s: float) -> bool:
    try:
        fd = os.open(item, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone (renamed into place, removed), a link, or not ours to read
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < grace_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it (or this file system has no locks)
            return False
        # Holding the lock, no writer can be at work on it; the name must still be this file.
        if os.stat(item, follow_symlinks=False).st_ino != st.st_ino:
            return False
        item.unlink()
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)

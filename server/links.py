"""Signed, expiring links to a video's content, for clients that cannot send a key.

A `<video src>` or `<img src>` sends no `Authorization` header, so with API keys on a browser could
only play a video it had downloaded whole (a blob). A link instead carries its own proof: an
HMAC-SHA256 over the video, the variant and the expiry time, made with a secret kept in the data
directory (created on first use, readable by its owner only). Every API host that shares the data
directory checks every other's links, and the file is the one thing to delete to revoke them all.
A link opens that one file until it expires; it names no key and grants nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlencode

from megaslide.engine.atomic import fsync_dir

SECRET_FILE = "link-signing.key"
DEFAULT_TTL_S = 3600
MAX_TTL_S = 7 * 24 * 3600


class LinkSigner:
    """Signs and checks links with the secret in `root/link-signing.key`, made there the first
    time a link is made or checked (two hosts racing to make it agree on the first one written);
    building an app writes nothing."""

    def __init__(self, root: Path):
        self.path = Path(root) / SECRET_FILE
        self._secret: bytes | None = None
        self._identity: tuple[int, ...] | None = None

    @property
    def secret(self) -> bytes:
        """The secret the file holds now. A stat per use keeps the copy in memory honest: once
        the file is deleted or replaced (on this host or another sharing the directory), links
        signed with the old secret stop opening at once, not at the next restart."""
        for _ in range(3):
            try:
                if self._secret is not None and _identity(os.stat(self.path)) == self._identity:
                    return self._secret
                return self._load()
            except FileNotFoundError:
                self._make()
        raise OSError(f"{SECRET_FILE} keeps disappearing while it is being read")

    def _load(self) -> bytes:
        # The identity comes from the descriptor read, so a file replaced between the stat and
        # the read is never cached under the old file's identity.
        with open(self.path, "rb") as f:
            secret = bytes.fromhex(f.read().decode().strip())
            self._secret, self._identity = secret, _identity(os.fstat(f.fileno()))
        return secret

    def _make(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never replaces: the first secret made stays
                fsync_dir(path.parent)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)

    def _signature(self, video_id: str, variant: str, expires: int) -> str:
        message = f"{video_id}\n{variant}\n{expires}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def query(self, video_id: str, variant: str, ttl_s: int) -> tuple[str, int]:
        """The query string of a link to `video_id`'s `variant` for `ttl_s` seconds, and its
        expiry (Unix seconds)."""
        expires = int(time.time()) + ttl_s
        signature = self._signature(video_id, variant, expires)
        return urlencode({"variant": variant, "expires": expires, "signature": signature}), expires

    def valid(self, video_id: str, variant: str, expires: str, signature: str) -> bool:
        """Whether `signature` is this signer's for the link and the link has not expired."""
        if not expires.isascii() or not expires.isdigit() or len(expires) > 12:
            return False
        if int(expires) < time.time():
            return False
        expected = self._signature(video_id, variant, int(expires))
        return hmac.compare_digest(expected, signature)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # Inode and device name the file; the times and size catch one recreated on a reused inode.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

"""API keys and whom they stand for: each key is a principal that owns what it makes.

Keys come from `MEGASLIDE_API_KEYS` (each key its own principal, named by a digest of it) and from
a keys file (`MEGASLIDE_API_KEYS_FILE`), which names principals and stores only the SHA-256 of
their keys, one per line:

    # name    sha256 of the key (megaslide keys new NAME prints both)            role
    alice     9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    alice     60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752
    ops       fd61a03af4f77d870fc21e05e7e80678095c92d808cfb3b5c279ee04c74aca13  admin

Two lines for one name are two keys of one principal: a key is rotated by adding the new line,
moving clients over and deleting the old line; what `alice` made stays hers throughout. A
principal sees and changes only its own videos, files, fine-tuning jobs and fine-tuned models
(another's answer 404, as if absent); base models are shared; an `admin` sees everything. Rows
made before keys were owners belong to no one and stay visible to every key. With no key
configured at all there is one anonymous principal and nothing is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
DIGEST = re.compile(r"[0-9a-f]{64}")
ROLES = ("user", "admin")


def digest(key: str) -> str:
    """The SHA-256 of a key, as the keys file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return f"msk-{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class Principal:
    """Who a request acts for. `name` None: authentication is off."""

    name: str | None
    admin: bool = False

    @property
    def owner(self) -> str | None:
        """What rows it makes are owned by."""
        return self.name

    @property
    def sees(self) -> str | None:
        """The owner its listings are restricted to; None: every row."""
        return None if self.admin else self.name

    @property
    def scope(self) -> str:
        """Its namespace for Idempotency-Keys: one principal cannot replay another's."""
        return self.name or "-"

    def may_see(self, owner: str | None) -> bool:
        return self.admin or self.name is None or owner is None or owner == self.name


ANONYMOUS = Principal(None, admin=True)


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: str
    admin: bool


class KeysFileError(ValueError):
    """A keys file line that is not `NAME SHA256 [admin]`."""


class Keyring:
    """The keys a server accepts, by digest."""

    def __init__(self, keys: list[str], keys_file: Path | None = None):
        entries = [_Entry(f"key-{digest(k)[:12]}", digest(k), False) for k in keys]
        if keys_file is not None:
            entries += read_keys_file(keys_file)
        self._entries = entries

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def principal(self, key: str) -> Principal | None:
        """Whom `key` stands for, or None. Every entry is compared, in constant time, so the time
        taken says nothing about which key matched or how much of a guess was right."""
        presented = digest(key).encode()
        found = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.digest.encode()) and found is None:
                found = Principal(entry.name, entry.admin)
        return found


def read_keys_file(path: Path) -> list[_Entry]:
    """The entries of a keys file; KeysFileError naming the line that is wrong."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}, line {number}"
        if len(fields) not in (2, 3):
            raise KeysFileError(f"{where}: expected NAME SHA256 [admin], got {len(fields)} fields")
        name, key_digest, *role = fields
        if not NAME.fullmatch(name):
            raise KeysFileError(f"{where}: {name!r} is not a name (letters, digits, _.@-)")
        if not DIGEST.fullmatch(key_digest):
            raise KeysFileError(f"{where}: the second field must be a key's SHA-256 in hex")
        if role and role[0] not in ROLES:
            raise KeysFileError(f"{where}: the role must be one of {', '.join(ROLES)}")
        entries.append(_Entry(name, key_digest, role == ["admin"]))
    return entries


__all__ = ["ANONYMOUS", "Keyring", "KeysFileError", "Principal", "digest", "new_key"]

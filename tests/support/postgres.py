"""A throwaway PostgreSQL server for the tests: initdb and pg_ctl in a temporary directory, on a
free loopback port, run as an unprivileged user (the server refuses to run as root).

Debian's `postgresql` package provides the binaries (`.ci/run` installs it when missing). Each
test gets a database of its own on the one server the session starts.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

SERVER_USER = "postgres"  # the account Debian's package creates, used when the tests run as root
DB_USER = "megaslide"


def _bin_dir() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if not versions:
        raise RuntimeError(
            "PostgreSQL is not installed (initdb not found): apt-get install postgresql"
        )
    return Path(versions[-1]).parent


def _version(path: str) -> int:
    return int(Path(path).parent.parent.name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One server, started on construction; `database()` makes a fresh database and returns its
    URL; `stop()` removes everything."""

    def __init__(self):
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="megaslide-pg-"))
        self.port = _free_port()
        self._names = itertools.count()
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as_user = ["runuser", "-u", SERVER_USER, "--"]
        data, log = self.root / "data", self.root / "server.log"
        self._run(
            "initdb", "-D", str(data), "-U", DB_USER, "-A", "trust", "-E", "UTF8", "--no-sync"
        )
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            # A test server: durability is not what is tested against it.
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "start")
        self.url = f"postgresql://{DB_USER}@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as_user, str(self.bin / tool), *args], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr or done.stdout}")

    def database(self) -> str:
        """A new, empty database: its URL."""
        import psycopg

        name = f"test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user={DB_USER} dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

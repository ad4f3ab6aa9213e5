"""A private PostgreSQL for Prefect servers on this machine: ``python -m devtools.postgres up``.

At SlimPajama scale teams run the Prefect server on PostgreSQL, not SQLite; the test command
(scripts/services-up.sh) starts this one so the data-stage benchmark and an end-to-end test run
against it, and ``url`` prints what to give a server:

    python -m devtools.postgres up                       # idempotent; well under a second when up
    python -m devtools.postgres create prefect           # a database owned by the 'nemoflow' role
    PREFECT_SERVER_DATABASE_CONNECTION_URL=$(python -m devtools.postgres url prefect) prefect server start

Debian's ``postgresql`` binaries (scripts/debian-packages.txt), a cluster of its own under
``/var/lib/nemoflow-postgres`` (``NEMOFLOW_POSTGRES_STATE_DIR``) owned by the ``postgres`` user,
listening on 127.0.0.1 only, on a private port (15432: a system PostgreSQL on 5432 is never
touched), with password (scram-sha-256) login for the role ``nemoflow``; the password is made at
the first ``up`` and kept in ``<state>/password`` (mode 0600). Administration (databases, sizes)
goes over the cluster's own Unix socket as ``postgres``, so it needs root, like starting it.
``down`` stops only this cluster.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_STATE_DIR = "/var/lib/nemoflow-postgres"
PORT = 15432
ROLE = "nemoflow"
OWNER = "postgres"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresError(RuntimeError):
    """The local PostgreSQL cannot be started or used; the message says why and what to do."""


def state_dir() -> Path:
    return Path(os.environ.get("NEMOFLOW_POSTGRES_STATE_DIR", DEFAULT_STATE_DIR))


def _bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise PostgresError(
            f"PostgreSQL's {tool} is not installed (Debian package 'postgresql'): run scripts/setup.sh --test as root"
        )
    return found[-1]


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise PostgresError(f"database name {name!r} must be lower-case letters, digits and '_' (max 63)")
    return name


class LocalPostgres:
    def __init__(self, root: str | Path | None = None, port: int = PORT):
        self.root = Path(root) if root else state_dir()
        self.port = port

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log" / "postgres.log"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    def password(self) -> str:
        try:
            return self.password_file.read_text().strip()
        except FileNotFoundError:
            raise PostgresError(f"no password at {self.password_file}: run `python -m devtools.postgres up`") from None

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL a Prefect server takes (PREFECT_SERVER_DATABASE_CONNECTION_URL)."""
        return f"postgresql+asyncpg://{ROLE}:{self.password()}@127.0.0.1:{self.port}/{_check_name(database)}"

    # ---------------------------------------------------------------- lifecycle

    def _as_owner(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        if os.geteuid() != 0:
            raise PostgresError("the local PostgreSQL is managed as root (it runs as the 'postgres' user)")
        return subprocess.run(
            ["runuser", "-u", OWNER, "--", *argv], capture_output=True, text=True, stdin=subprocess.DEVNULL, **kwargs
        )

    def is_up(self) -> bool:
        proc = subprocess.run(
            [_bin("pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port), "-t", "2"], capture_output=True
        )
        return proc.returncode == 0

    def up(self, timeout: float = 60) -> None:
        if self.is_up() and self.password_file.exists():
            return
        for path in (self.root, self.socket_dir, self.log.parent):
            path.mkdir(parents=True, exist_ok=True)
            shutil.chown(path, OWNER, OWNER)
        self.root.chmod(0o755)
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(exist_ok=True)
            shutil.chown(self.data, OWNER, OWNER)
            self.data.chmod(0o700)
            init = self._as_owner(
                [
                    _bin("initdb"),
                    "-D",
                    str(self.data),
                    "--auth-local=peer",
                    "--auth-host=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                ]
            )
            if init.returncode != 0:
                raise PostgresError(f"initdb failed:\n{init.stdout[-1500:]}{init.stderr[-1500:]}")
        if not self.is_up():
            options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
            start = self._as_owner(
                [
                    _bin("pg_ctl"),
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    options,
                    "-w",
                    "-t",
                    str(int(timeout)),
                ]
                + ["start"]
            )
            if start.returncode != 0:
                tail = self.log.read_text(errors="replace").splitlines()[-10:] if self.log.exists() else []
                raise PostgresError("PostgreSQL did not start:\n" + start.stderr[-1000:] + "\n".join(tail))
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if time.monotonic() > deadline:
                raise PostgresError(f"PostgreSQL did not accept connections on port {self.port} (see {self.log})")
            time.sleep(0.2)
        self._ensure_role()

    def _ensure_role(self) -> None:
        if not self.password_file.exists():
            self.password_file.write_text(secrets.token_hex(16) + "\n")
            self.password_file.chmod(0o600)
        password = self.password()
        self.sql(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ROLE}') THEN "
            f"CREATE ROLE {ROLE} LOGIN CREATEDB; END IF; END $$;"
            f"ALTER ROLE {ROLE} PASSWORD '{password}';"
        )

    def down(self) -> bool:
        if not (self.data / "PG_VERSION").exists() or not self.is_up():
            return False
        stop = self._as_owner([_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"])
        if stop.returncode != 0:
            raise PostgresError(f"pg_ctl stop failed: {stop.stderr.strip()}")
        return True

    # ---------------------------------------------------------------- administration

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run SQL as the cluster owner over its Unix socket; returns the unaligned output."""
        proc = self._as_owner(
            [_bin("psql"), "-h", str(self.socket_dir), "-p", str(self.port), "-d", database]
            + ["-v", "ON_ERROR_STOP=1", "-qAtX", "-c", statement]
        )
        if proc.returncode != 0:
            raise PostgresError(f"psql failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def create_database(self, name: str) -> str:
        """A fresh, empty database owned by the nemoflow role (an existing one is dropped first)."""
        self.drop_database(name)
        self.sql(f"CREATE DATABASE {_check_name(name)} OWNER {ROLE}")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {_check_name(name)} WITH (FORCE)")

    def database_size(self, name: str) -> int:
        """Bytes on disk (``pg_database_size``: tables, indexes and TOAST of that database)."""
        return int(self.sql(f"SELECT pg_database_size('{_check_name(name)}')"))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m devtools.postgres", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["up", "down", "status", "url", "create", "drop", "size"])
    parser.add_argument("database", nargs="?", default="prefect", help="for url/create/drop/size (default: prefect)")
    args = parser.parse_args(argv)
    pg = LocalPostgres()
    try:
        if args.action == "up":
            pg.up()
            print(f"PostgreSQL up on 127.0.0.1:{pg.port} (state {pg.root})")
        elif args.action == "down":
            print("stopped" if pg.down() else "not running")
        elif args.action == "status":
            up = pg.is_up()
            print(f"PostgreSQL on 127.0.0.1:{pg.port}: {'up' if up else 'down'} (state {pg.root})")
            return 0 if up else 1
        elif args.action == "url":
            print(pg.url(args.database))
        elif args.action == "create":
            pg.create_database(args.database)
            print(f"created database {args.database}")
        elif args.action == "drop":
            pg.drop_database(args.database)
        elif args.action == "size":
            print(pg.database_size(args.database))
    except PostgresError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

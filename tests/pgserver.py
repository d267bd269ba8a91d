"""A throwaway PostgreSQL cluster for tests, run from the server binaries of Debian's ``postgresql`` package.

``PostgresServer().start()`` runs ``initdb`` into a temporary folder and starts ``postgres`` on a unix socket in that
folder (no TCP port, so parallel sessions and other servers on the machine never collide). As root, the cluster runs
as the ``postgres`` user the package creates (PostgreSQL refuses to run as root). ``create_database()`` returns a
``postgresql+psycopg://`` URL of a new, empty database; ``stop()`` ends the server and deletes the folder.

The cluster is tuned for tests, not for durability across an OS crash: ``fsync=off`` (a killed *process* loses
nothing that was committed, since written pages sit in the OS cache; only a machine crash would).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

SERVER_USER = "postgres"  # the account Debian's postgresql package creates; used when the tests run as root
REQUIRE_ENV = "POSTGRES_TEST_REQUIRE_SERVER"
BIN_DIR_ENV = "POSTGRES_BIN_DIR"
INSTALL_HINT = "install it with: sudo apt-get install postgresql (or run `make postgres-deps` as root)"


class PostgresUnavailableError(RuntimeError):
    """No PostgreSQL server binaries here, or the cluster did not start: the message says which and what to do."""


def find_bin_dir() -> Path | None:
    """``$POSTGRES_BIN_DIR``, else the newest ``/usr/lib/postgresql/*/bin`` (Debian), else the folder of ``pg_ctl``
    on PATH; None when there is no ``initdb`` + ``pg_ctl`` + ``postgres`` anywhere."""
    candidates: list[Path] = []
    if os.environ.get(BIN_DIR_ENV):
        candidates.append(Path(os.environ[BIN_DIR_ENV]))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                      if Path(p).parent.name.isdigit() else 0, reverse=True)
    candidates.extend(Path(p) for p in versions)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


def require_server() -> bool:
    """Whether a missing server fails the tests instead of skipping them (``make test`` sets it as root)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


class PostgresServer:
    """One cluster: ``start()``, ``create_database()`` / ``drop_database()``, ``kill()`` / ``restart()``, ``stop()``."""

    def __init__(self, bin_dir: Path | None = None, *, prefix: str = "multicomposite-pg-") -> None:
        found = bin_dir or find_bin_dir()
        if found is None:
            raise PostgresUnavailableError(f"no PostgreSQL server binaries (initdb, pg_ctl, postgres) found in "
                                           f"/usr/lib/postgresql/*/bin, ${BIN_DIR_ENV} or PATH; {INSTALL_HINT}")
        self.bin_dir = found
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=_temp_parent()))
        self.data = self.root / "data"
        self.socket_dir = self.root  # the socket lives beside the data: .s.PGSQL.<port>
        self.log = self.root / "server.log"
        self.port = 5432  # only names the socket file; nothing listens on TCP
        self.user = "postgres"  # the cluster's superuser (initdb -U); trust auth on the socket only
        self._run_as: dict[str, object] = {}
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam(SERVER_USER)
            except KeyError:
                raise PostgresUnavailableError(f"running as root, and there is no {SERVER_USER!r} user to run "
                                               f"PostgreSQL as (it refuses root); {INSTALL_HINT}") from None
            # Drop root's groups too, not only its uid: the cluster's files belong to postgres alone.
            self._run_as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            shutil.chown(self.root, SERVER_USER)
        self.started = False

    # Processes ---------------------------------------------------------------------------------------------------

    def _run(self, args: Sequence[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        result = subprocess.run(command, **self._run_as, capture_output=True, text=True, timeout=timeout,
                                cwd=self.root, env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"})
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            log_tail = self.log.read_text(errors="replace").strip().splitlines()[-5:] if self.log.exists() else []
            raise PostgresUnavailableError(f"{args[0]} failed with exit code {result.returncode}: "
                                           f"{' | '.join(tail + log_tail)}")
        return result

    def start(self) -> PostgresServer:
        """initdb (first time only) and start the server; returns once it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            self._run(["initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "--encoding=UTF8",
                       "--no-instructions", "--no-sync"])
            settings = {
                "listen_addresses": "''",
                "unix_socket_directories": f"'{self.socket_dir}'",
                "port": str(self.port),
                "fsync": "off",
                "full_page_writes": "off",
                "max_connections": "100",
                "shared_buffers": "32MB",
                "log_min_messages": "warning",
            }
            with open(self.data / "postgresql.conf", "a") as conf:
                conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start"])
        self.started = True
        return self

    def postmaster_pid(self) -> int:
        """The server's main process id (first line of postmaster.pid)."""
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    def _server_pids(self) -> list[int]:
        """The postmaster and its children (backends, background workers), read from /proc."""
        main = self.postmaster_pid()
        pids = [main]
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == main:
                pids.append(int(Path(stat).parent.name))
        return pids

    def kill(self, *, timeout: float = 30) -> None:
        """``kill -9`` the postmaster, as a crash would, and wait until its children are gone too (they notice the
        postmaster's death and exit; until then the shared memory they hold would block a restart)."""
        pids = self._server_pids()
        os.kill(pids[0], 9)
        deadline = time.monotonic() + timeout
        for pid in pids:
            while _alive(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, 9)  # a child of our own server that outlived its postmaster
                    break
                time.sleep(0.02)
        # The postmaster may stay a zombie where no init reaps orphans (a container): postgres would take its pid in
        # the lock files for a live server and refuse to start. It is dead; remove them as an admin would.
        for lock in (self.data / "postmaster.pid", self.socket_dir / f".s.PGSQL.{self.port}.lock",
                     self.socket_dir / f".s.PGSQL.{self.port}"):
            lock.unlink(missing_ok=True)
        self.started = False

    def restart(self) -> None:
        """Start again after ``kill()`` (crash recovery replays the WAL) or ``stop()`` without cleanup."""
        self.start()

    def stop(self, *, cleanup: bool = True) -> None:
        """Stop the server (immediate shutdown: nothing here needs a checkpoint) and delete its folder."""
        if self.started:
            try:
                self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"], timeout=60)
            finally:
                self.started = False
        if cleanup:
            shutil.rmtree(self.root, ignore_errors=True)

    # Databases ---------------------------------------------------------------------------------------------------

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` on this server (psycopg 3, over the unix socket)."""
        return f"postgresql+psycopg://{self.user}@/{database}?host={self.socket_dir}&port={self.port}"

    def libpq_url(self, database: str = "postgres") -> str:
        """The same database as a libpq URI (``postgresql://``), for psycopg or procrastinate directly."""
        return f"postgresql://{self.user}@/{database}?host={self.socket_dir}&port={self.port}"

    def execute(self, sql: str, *, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement in autocommit mode as the superuser; returns the rows, if any."""
        import psycopg

        with psycopg.connect(host=str(self.socket_dir), port=self.port, user=self.user, dbname=database,
                             autocommit=True) as conn, conn.cursor() as cursor:
            cursor.execute(sql.encode())
            return cursor.fetchall() if cursor.description else []

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; returns its URL."""
        name = name or f"test_{uuid.uuid4().hex[:12]}"
        # FILE_COPY (PostgreSQL 15+) copies template0's few files instead of WAL-logging every block: faster here.
        version = int(self.execute("SHOW server_version_num")[0][0])  # type: ignore[call-overload]
        strategy = " STRATEGY FILE_COPY" if version >= 150000 else ""
        self.execute(f'CREATE DATABASE "{name}" TEMPLATE template0{strategy}')
        return self.url(name)

    def drop_database(self, url_or_name: str) -> None:
        """Drop a database, ending any connection still open to it."""
        name = url_or_name.split("/")[-1].split("?")[0]
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _temp_parent() -> str:
    """Where the cluster's folder goes: the temp dir, unless the socket path would pass the 107 bytes a unix socket
    allows, or (as root) the ``postgres`` user could not reach it (a TMPDIR under /root): then /tmp."""
    parent = tempfile.gettempdir()
    too_long = len(parent) > 60  # + /multicomposite-pg-XXXXXXXX/.s.PGSQL.5432.lock
    unreachable = os.geteuid() == 0 and any(not (Path(folder).stat().st_mode & 0o001)
                                            for folder in (parent, *map(str, Path(parent).parents)))
    return "/tmp" if (too_long or unreachable) and Path("/tmp").is_dir() else parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

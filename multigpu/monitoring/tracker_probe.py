"""Whether each --logger tracker can be reached and written, checked in seconds before training (PITFALLS 41).

MLflow's HTTP client retries an address nobody answers at for minutes, its database store retries a file it
cannot open for as long, and W&B waits 90 s for its server: each looked like a hung run, which a first SIGTERM
did not end. So before the save-dir is claimed (nothing moved aside yet), rank 0 tries each tracker's store with
a bounded check, and a tracker that cannot be used is one line and exit 2 on every rank:

- mlflow: a tracking server (http, https, or a database at HOST:PORT) accepts a connection within PROBE_SECONDS;
  a SQLite store (the default, `<save-dir>/mlflow.db`) takes a write, rolled back, within PROBE_SECONDS (a
  read-only file or file system, or a lock held longer, fails it), or where there is none yet its folder takes
  a file; MLflow's file store's folder takes a file;
- wandb: online, its server (WANDB_BASE_URL) accepts a connection within PROBE_SECONDS; offline, WANDB_DIR
  takes a file.

What fails later, mid-run, is a warning and the tracker left off (multigpu/monitoring/trackers.py), its calls
bounded by the same kind of timeout (`bound_mlflow_requests`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import tempfile
from urllib.parse import urlsplit

from multigpu.config import TrainConfig

PROBE_SECONDS = 3.0
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
WANDB_SERVER = "https://api.wandb.ai"
WANDB_OFFLINE = ("offline", "dryrun", "disabled")


def refusal(config: TrainConfig, mlflow_uri: str) -> str | None:
    """The one line refusing the first --logger tracker that cannot be reached or written, or None; `mlflow_uri`
    the tracking URI MLflow's tracker would use."""
    for name in config.loggers:
        problem = None
        if name == "mlflow":
            problem = _mlflow(mlflow_uri)
        elif name == "wandb":
            problem = _wandb(config)
        if problem is not None:
            return f"--logger {name}: {problem}; or leave {name} out of --logger"
    return None


def _mlflow(uri: str) -> str | None:
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if "://" in uri else "file"
    if scheme == "sqlite":
        return _sqlite_writable(uri)
    if scheme == "file":
        folder = urlsplit(uri).path if "://" in uri else uri
        return _folder_writable(folder, f"MLflow's file store {uri}")
    if scheme == "databricks":
        return None  # a workspace profile, not an address: its client says what is wrong
    return _reachable(uri, f"the MLflow tracking server at MLFLOW_TRACKING_URI={uri}")


def _wandb(config: TrainConfig) -> str | None:
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE:
        folder = os.environ.get("WANDB_DIR")
        return _folder_writable(folder, f"WANDB_DIR {folder}") if folder else None  # else: the save-dir's
    server = os.environ.get("WANDB_BASE_URL") or WANDB_SERVER
    problem = _reachable(server, f"W&B's server {server}")
    return None if problem is None else f"{problem}, or set WANDB_MODE=offline"


def _reachable(address: str, what: str) -> str | None:
    """None when `address`'s host accepts a TCP connection within PROBE_SECONDS, else what failed."""
    parts = urlsplit(address)
    scheme = parts.scheme.split("+", 1)[0].lower()
    try:
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return f"{what}: not an address with a valid port"
    if not parts.hostname or port is None:
        return None  # nothing to connect to here (a socket path, a driver's own default): its client decides
    try:
        socket.create_connection((parts.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        reason = (
            f"no answer within {PROBE_SECONDS:g} s"
            if isinstance(error, TimeoutError)
            else error.strerror or str(error)
        )
        return f"cannot reach {what} ({reason}); start it, or point the tracker at one that runs"
    return None


def _sqlite_writable(uri: str) -> str | None:
    """None when the SQLite database of `uri` takes a write (rolled back), or its folder a new file."""
    path = uri.split("?", 1)[0].removeprefix("sqlite:///").removeprefix("sqlite+pysqlite:///")
    if not path or path == ":memory:" or uri.startswith("sqlite://") and not uri.startswith("sqlite:///"):
        return None  # an in-memory database
    if not os.path.exists(path):
        return _folder_writable(os.path.dirname(os.path.abspath(path)), f"MLflow's store {path}")
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=PROBE_SECONDS, isolation_level=None)) as db:
            db.execute("BEGIN IMMEDIATE")  # the write lock, waited for at most PROBE_SECONDS
            db.execute("CREATE TABLE multigpu_write_probe (x)")  # a write: the journal is created
            db.execute("ROLLBACK")
    except sqlite3.Error as error:
        return f"cannot write MLflow's store {path} ({error}); give a store this user can write"
    return None


def _folder_writable(folder: str, what: str) -> str | None:
    """None when `folder` (or, not there yet, the nearest folder above it, where it would be made) takes a new
    file, created and removed; else why not."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"cannot write {what} ({error.strerror or error} in {existing}); give a folder this user can write"
    return None


def bound_mlflow_requests() -> None:
    """MLflow's HTTP requests failing within seconds instead of minutes: 5 s a request, 2 retries a second
    apart, unless the environment sets them (MLflow reads them at each request), so a server lost mid-run costs
    seconds once, then the tracker is left off."""
    defaults = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)

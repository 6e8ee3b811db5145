"""Running the server as a service: a systemd unit where systemd is the init system, else a detached background
process (``appliance serve --config PATH`` in its own session) with a pid file and a log file in the state folder.

Both managers answer the same calls (``start``, ``status``, ``stop``, ``logs``, ``uninstall``), so the command line
does not care which one runs the server; :func:`manager` picks the one in charge.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil

from appliance.errors import ApplianceError
from engine.errors import ENGINE_DIED_LOG

UNIT_NAME = "appliance.service"
_TEMPLATE = "appliance.service.in"


class ServiceError(ApplianceError):
    pass


@dataclass
class Status:
    mode: str  # "systemd", "systemd-user" or "background"
    running: bool
    pid: int | None = None
    detail: str = ""
    log: str = ""  # where the logs are: a file, or the journalctl command
    installed: bool = True  # False once `appliance uninstall` removed the service (and nothing started it since)
    restarts: int = 0  # times systemd restarted the unit's process since it was started (Restart=on-failure)


def systemd_running() -> bool:
    """True when systemd is PID 1 (the test sd_booted() makes: /run/systemd/system exists)."""
    if Path("/run/systemd/system").is_dir():
        return True
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _tail(lines, n: int) -> list[str]:
    return list(deque(lines, maxlen=n)) if n > 0 else []


def tail_file(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a text file (without line ends); [] when it does not exist."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in _tail(f, n)]
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------------------------------- systemd


def template_path() -> Path:
    """The unit template. ``appliance/systemd`` links to the repository's ``systemd/``, so the file is package data
    (pyproject's ``appliance = ["systemd/*"]``) in a wheel as much as in an editable install."""
    path = Path(__file__).resolve().parent / "systemd" / _TEMPLATE
    if not path.is_file():
        raise ServiceError(f"the unit template {_TEMPLATE} is missing", "reinstall edge-appliance")
    return path


def render_unit(config_path: Path | str, data_dir: Path | str, *, python: str | None = None,
                env_file: Path | str | None = None, user: bool = False) -> str:
    """The unit text: ``python -m appliance serve --config CONFIG``, restarted on failure."""
    config_path = Path(config_path)
    values = {
        "@PYTHON@": python or sys.executable,
        "@CONFIG@": str(config_path),
        "@ENV_FILE@": str(env_file or config_path.parent / "appliance.env"),
        "@DATA_DIR@": str(data_dir),
        "@WANTED_BY@": "default.target" if user else "multi-user.target",
    }
    text = template_path().read_text()
    for key, value in values.items():
        if any(c.isspace() for c in value):
            raise ServiceError(f"the path {value!r} contains a space, which a unit file cannot take here",
                               "use paths without spaces (APPLIANCE_DATA_DIR, XDG_CONFIG_HOME)")
        text = text.replace(key, value)
    return text


class Systemd:
    """The unit ``appliance.service``: system-wide (root) or in the user's own systemd instance."""

    def __init__(self, user: bool = False):
        self.user = user
        self.mode = "systemd-user" if user else "systemd"

    @property
    def unit_path(self) -> Path:
        if self.user:
            base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
            return Path(base) / "systemd" / "user" / UNIT_NAME
        return Path("/etc/systemd/system") / UNIT_NAME

    def _systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["systemctl", *(["--user"] if self.user else []), *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise ServiceError("systemctl is not installed", "use --no-service for a background process") from None
        if check and proc.returncode != 0:
            raise ServiceError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}",
                               "see `appliance logs` and `journalctl -xe`")
        return proc

    def installed(self) -> bool:
        return self.unit_path.is_file()

    def install(self, config_path: Path, data_dir: Path) -> Path:
        """Write the unit (atomically), reload systemd, enable it and (re)start it."""
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(self.unit_path, render_unit(config_path, data_dir, user=self.user))
        self._systemctl("daemon-reload")
        self._systemctl("enable", UNIT_NAME)
        self._systemctl("restart", UNIT_NAME)
        return self.unit_path

    def start(self) -> None:
        self._systemctl("start", UNIT_NAME)

    def status(self) -> Status:
        active = self._systemctl("is-active", UNIT_NAME, check=False).stdout.strip()
        shown = self._systemctl("show", "-p", "MainPID", "-p", "NRestarts", UNIT_NAME, check=False).stdout
        props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
        pid, restarts = props.get("MainPID", ""), props.get("NRestarts", "")
        return Status(mode=self.mode, running=active == "active",
                      pid=int(pid) if pid.isdigit() and pid != "0" else None,
                      restarts=int(restarts) if restarts.isdigit() else 0,
                      detail=f"unit {self.unit_path}: {active or 'unknown'}",
                      log=f"journalctl {'--user-unit' if self.user else '-u'} {UNIT_NAME}")

    def stop(self) -> bool:
        was_running = self.status().running
        self._systemctl("stop", UNIT_NAME)
        return was_running

    def log_lines(self, n: int = 50) -> list[str]:
        cmd = ["journalctl", "--user-unit" if self.user else "-u", UNIT_NAME, "-n", str(n), "--no-pager", "-o", "cat"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return proc.stdout.splitlines()

    def follow(self, n: int = 50) -> None:
        """Print the last ``n`` lines, then new ones as they come (journalctl -f; does not return)."""
        os.execvp("journalctl", ["journalctl", "--user-unit" if self.user else "-u", UNIT_NAME, "-n", str(n), "-f",
                                 "-o", "cat"])

    def uninstall(self) -> bool:
        if not self.installed():
            return False
        self._systemctl("disable", "--now", UNIT_NAME, check=False)
        self.unit_path.unlink()
        self._systemctl("daemon-reload", check=False)
        return True


# ----------------------------------------------------------------------------------------------- background


class Background:
    """A detached ``appliance serve`` in its own session; ``appliance.pid`` and ``appliance.log`` in ``state_dir``.

    The pid file holds the pid and the process's start time, so a recycled pid is never mistaken for the server.
    :meth:`uninstall` leaves the file ``uninstalled`` beside them (the log stays), which :meth:`start` removes, so
    :meth:`status` can tell a removed service from a stopped one.
    """

    mode = "background"

    def __init__(self, state_dir: Path | str):
        self.state_dir = Path(state_dir)
        self.pid_file = self.state_dir / "appliance.pid"
        self.log_file = self.state_dir / "appliance.log"
        self.uninstalled_file = self.state_dir / "uninstalled"

    def _recorded(self) -> tuple[int, float] | None:
        try:
            pid, started = self.pid_file.read_text().split()
            return int(pid), float(started)
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        recorded = self._recorded()
        if recorded is None:
            return None
        pid, started = recorded
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        except ChildProcessError:
            pass
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) > 1 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            return None
        return pid

    def start(self, command: list[str]) -> int:
        """Start ``command`` detached (new session, stdin from /dev/null, output appended to the log)."""
        if self.pid() is not None:
            raise ServiceError(f"the server is already running (pid {self.pid()})", "run `appliance stop` first")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.state_dir, start_new_session=True, close_fds=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc.returncode = 0  # detached on purpose: no "still running" warning when this object goes away
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = time.time()
        write_atomic(self.pid_file, f"{proc.pid} {started}\n")
        self.uninstalled_file.unlink(missing_ok=True)
        return proc.pid

    def status(self) -> Status:
        pid = self.pid()
        if pid is not None:
            detail = f"background process {pid}"
        elif self.uninstalled_file.is_file():
            return Status(mode=self.mode, running=False, detail="removed by `appliance uninstall`",
                          log=str(self.log_file), installed=False)
        elif self._recorded() is not None:
            detail = "stopped (the process exited; see the log)"
            if self._engine_died():  # no supervisor starts it again here
                detail = f"stopped: {ENGINE_DIED_LOG} (see the log); `appliance start` starts it again"
        elif self.log_file.is_file():
            detail = "stopped"
        else:
            detail = "not started"
        return Status(mode=self.mode, running=pid is not None, pid=pid, detail=detail, log=str(self.log_file))

    def _engine_died(self) -> bool:
        """Whether the server's last run logged that its engine died while serving (the lines after the last
        "starting" line :meth:`start` wrote, of the log's last 50)."""
        lines = self.log_lines(50)
        starts = [i for i, line in enumerate(lines) if line.startswith("--- ") and " starting: " in line]
        return any(ENGINE_DIED_LOG in line for line in lines[starts[-1] if starts else 0:])

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM the server's process group, SIGKILL it after ``timeout``; True if it was running. Returns once
        no process of the group is left (the server's own children too, so its port and GPU memory are free)."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            except PermissionError:
                raise ServiceError(f"not allowed to stop process {pid}",
                                   "run the command as the user who started it") from None
            deadline = time.monotonic() + timeout
            while (self.pid() is not None or _group_alive(pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.pid() is None and not _group_alive(pid):
                break
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_lines(self, n: int = 50) -> list[str]:
        return tail_file(self.log_file, n)

    def follow(self, n: int = 50) -> None:
        """Print the last ``n`` lines of the log, then new ones as they come (until interrupted)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.touch()
        with open(self.log_file, errors="replace") as f:
            for line in _tail(f, n):
                sys.stdout.write(line)
            while True:
                line = f.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)

    def uninstall(self) -> bool:
        """Stop the server and mark the service removed (see the class doc); True if it was running."""
        was = self.stop()
        self.pid_file.unlink(missing_ok=True)
        write_atomic(self.uninstalled_file, f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        return was


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is left (zombies count until their parent reaps them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve_command(config_path: Path | str) -> list[str]:
    """The background server's command: ``appliance serve`` with the config's absolute path (it runs in
    ``state_dir``)."""
    return [sys.executable, "-m", "appliance", "serve", "--config", str(Path(config_path).resolve())]


def state_dir(data_dir: Path | str) -> Path:
    return Path(data_dir) / "run"


def manager(data_dir: Path | str) -> Systemd | Background:
    """The manager in charge: an installed unit while systemd runs, else the background process."""
    if systemd_running():
        for unit in (Systemd(user=False), Systemd(user=True)):
            if unit.installed():
                return unit
    return Background(state_dir(data_dir))

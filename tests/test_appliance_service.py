"""appliance.service: the systemd unit renders and verifies; the background fallback starts, reports, logs and
stops a (tiny fake) server, also through the `appliance status/stop/logs` commands."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from appliance_testenv import isolate
from typer.testing import CliRunner

from appliance import installer, service
from appliance.cli import app

FAKE_SERVER = [sys.executable, "-c",
               "import time; print('fake server up', flush=True); time.sleep(300)"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(service, "systemd_running", lambda: False)


@pytest.fixture
def bg(tmp_path):
    mgr = service.Background(service.state_dir(tmp_path / "data"))
    yield mgr
    mgr.stop(timeout=5)


def _model(tmp_path) -> Path:
    """A model folder the planner reads (config.json and a safetensors file; nothing loads it)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
                                       '"max_position_embeddings": 1024}')
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    return model


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _flat(result) -> str:
    """A command's output with the console's line wrapping undone."""
    return " ".join(result.output.split())


def wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_rendered_unit_runs_serve_with_the_config(tmp_path):
    text = service.render_unit(tmp_path / "etc" / "config.toml", tmp_path / "data", python="/usr/bin/python3")
    assert f"ExecStart=/usr/bin/python3 -m appliance serve --config {tmp_path}/etc/config.toml" in text
    assert f"EnvironmentFile=-{tmp_path}/etc/appliance.env" in text
    assert f"WorkingDirectory={tmp_path}/data" in text
    assert "WantedBy=multi-user.target" in text and "Restart=on-failure" in text
    assert "@" not in text  # every placeholder filled
    assert "WantedBy=default.target" in service.render_unit("/c.toml", "/d", user=True)
    with pytest.raises(service.ServiceError, match="space"):
        service.render_unit(tmp_path / "my config.toml", tmp_path)


def test_unit_template_is_package_data():
    """A wheel (``pip install .``, not -e) carries the template: pyproject's package-data globs, taken from the
    ``appliance`` package folder as setuptools does, match the file ``template_path`` reads."""
    from appliance.config import tomllib
    root = Path(service.__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["appliance"]
    package = Path(service.__file__).parent
    found = [path for pattern in globs for path in package.glob(pattern)]
    assert package / "systemd" / "appliance.service.in" in found
    assert service.template_path().read_text() == (root / "systemd" / "appliance.service.in").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_rendered_unit_passes_systemd_analyze_verify(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    unit = tmp_path / service.UNIT_NAME
    unit.write_text(service.render_unit(tmp_path / "config.toml", data, python=sys.executable))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if service.UNIT_NAME in line]
    assert proc.returncode == 0 and complaints == [], proc.stdout + proc.stderr


def test_background_start_status_logs_stop(bg):
    assert bg.status().running is False and bg.status().detail == "not started"
    pid = bg.start(FAKE_SERVER)
    assert os.getsid(pid) == pid  # its own session: detached from ours
    st = bg.status()
    assert (st.mode, st.running, st.pid, st.log) == ("background", True, pid, str(bg.log_file))
    assert bg.pid_file.read_text().split()[0] == str(pid)
    assert wait_for(lambda: "fake server up" in bg.log_lines(5))
    with pytest.raises(service.ServiceError, match="already running"):
        bg.start(FAKE_SERVER)
    assert bg.stop(timeout=10) is True
    assert not bg.pid_file.exists()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert bg.status().running is False
    assert bg.stop() is False


def test_server_that_exits_is_reported_stopped(bg):
    bg.start([sys.executable, "-c", "print('bye')"])
    assert wait_for(lambda: not bg.status().running)
    assert "exited" in bg.status().detail
    assert "bye" in bg.log_lines(5)


def test_a_server_whose_engine_died_is_reported_with_the_fix(bg):
    """Only the last run's lines count: a clean run after the death is plainly "exited"."""
    from engine.errors import ENGINE_DIED_LOG

    died = [sys.executable, "-c", f"print('ERROR {ENGINE_DIED_LOG} (RuntimeError()): exits'); raise SystemExit(1)"]
    bg.start(died)
    assert wait_for(lambda: not bg.status().running)
    assert bg.status().detail == (f"stopped: {ENGINE_DIED_LOG} (see the log); `appliance start` starts it again")
    bg.start([sys.executable, "-c", "print('bye')"])
    assert wait_for(lambda: not bg.status().running)
    assert bg.status().detail == "stopped (the process exited; see the log)"


def test_recycled_pid_is_not_mistaken_for_the_server(bg):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another program, same pid
    try:
        bg.state_dir.mkdir(parents=True)
        bg.pid_file.write_text(f"{other.pid} 12345.0\n")  # a live pid, but not started at that time
        assert bg.status().running is False
        assert bg.stop() is False
        time.sleep(0.2)
        assert other.poll() is None  # not signalled
    finally:
        other.kill()
        other.wait()


def test_sigterm_ignored_then_killed(bg):
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(300)"]
    bg.start(stubborn)
    assert wait_for(lambda: "ready" in bg.log_lines(5))
    assert bg.stop(timeout=1) is True
    assert bg.status().running is False


def test_manager_without_systemd_is_the_background_process(tmp_path):
    mgr = service.manager(tmp_path / "data")
    assert isinstance(mgr, service.Background) and mgr.state_dir == tmp_path / "data" / "run"


def test_status_stop_logs_commands(bg, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["status"])  # nothing installed: no config
    assert result.exit_code == 4 and f"not installed: no config at {tmp_path / 'config.toml'}" in _flat(result)
    result = runner.invoke(app, ["logs"])  # as status: nothing to show is said, not an empty success
    assert result.exit_code == 4 and f"not installed: no log, no config at {tmp_path / 'config.toml'}" in _flat(result)
    result = runner.invoke(app, ["logs", "-f"])  # it waited forever, on a log file it made
    assert result.exit_code == 4 and "not installed: no log" in _flat(result) and not (tmp_path / "data").exists()
    (tmp_path / "config.toml").write_text(f'port = {_free_port()}\n')  # what an install writes, more or less
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 3 and "not running" in result.output
    pid = bg.start(FAKE_SERVER)
    assert wait_for(lambda: "fake server up" in bg.log_lines(5))
    result = runner.invoke(app, ["status"])  # the process runs; nothing answers on its port
    assert result.exit_code == 0, result.output
    assert "starting" in result.output and str(pid) in result.output and "not answering" in _flat(result)
    from appliance.cli import doctor_checks
    health = next(c for c in doctor_checks(tmp_path / "config.toml") if c[1].startswith("/health"))
    assert health[0] is True and health[1].endswith(": starting (not listening yet)")
    import appliance.cli as cli
    wait, cli.LOAD_WAIT_S = cli.LOAD_WAIT_S, 1.0  # bench waits for a starting server (600 s), then says so
    try:
        began = time.monotonic()
        early = runner.invoke(app, ["bench", "--concurrency", "1"])
    finally:
        cli.LOAD_WAIT_S = wait
    assert early.exit_code == 1 and "is starting (not listening yet)" in _flat(early), early.output
    assert 1.0 <= time.monotonic() - began < 30
    startup, cli.STARTUP_S = cli.STARTUP_S, 0.0  # as if it had been up longer than a start takes
    try:
        hung = runner.invoke(app, ["status"])
    finally:
        cli.STARTUP_S = startup
    assert hung.exit_code == 1 and "not answering" in hung.output and "endpoint" not in hung.output
    assert "s old" in _flat(hung) and "ConnectError" in _flat(hung)
    cli.STARTUP_S = 0.0
    try:
        late = runner.invoke(app, ["bench", "--concurrency", "1"])
        health = next(c for c in doctor_checks(tmp_path / "config.toml") if c[1].startswith("/health"))
    finally:
        cli.STARTUP_S = startup
    assert late.exit_code == 1 and "no server answers" in _flat(late)
    assert health[0] is False and "the process is" in health[2]
    result = runner.invoke(app, ["logs", "-n", "5"])
    assert result.exit_code == 0 and "fake server up" in result.output
    result = runner.invoke(app, ["stop"])
    assert result.exit_code == 0 and "stopped" in result.output
    assert bg.status().running is False
    assert "not running" in runner.invoke(app, ["stop"]).output


def test_a_config_with_an_error_still_stops_logs_and_uninstalls(bg, tmp_path, monkeypatch):
    """stop, logs and uninstall need only the data folder: a typo in the config or a bad APPLIANCE_* value is warned
    about, and the server is still stopped (it was not: the error blocked even `uninstall --purge`); its
    data_dir is read from the file alone where the environment has none. A --config that does not exist is an
    error, not the installed server's defaults."""
    runner = CliRunner()
    (tmp_path / "config.toml").write_text("max_num_seq = 8\n")  # a typo in a key
    bg.start(FAKE_SERVER)
    assert wait_for(lambda: "fake server up" in bg.log_lines(5))
    result = runner.invoke(app, ["logs", "-n", "5"])
    assert result.exit_code == 0 and "fake server up" in result.output, result.output
    assert "warning:" in _flat(result) and "unknown key 'max_num_seq'" in _flat(result)
    nope = str(tmp_path / "nope.toml")
    missing = runner.invoke(app, ["stop", "--config", nope])
    assert missing.exit_code == 1 and f"no config at {nope}" in _flat(missing)
    for command, code, said in ((["status"], 4, "not installed: no config at"), (["logs"], 4, "not installed: no log"),
                                (["uninstall", "--yes", "--purge"], 0, "nothing to uninstall")):
        result = runner.invoke(app, [*command, "--config", nope])  # not the installed server's answer
        assert result.exit_code == code and said in _flat(result), (command, result.output)
    assert bg.status().running and (tmp_path / "config.toml").is_file()
    result = runner.invoke(app, ["logs", "-n", "1", "--config", str(tmp_path / "config.toml")])  # named: the same
    assert result.exit_code == 0 and "unknown key 'max_num_seq'" in _flat(result), result.output
    monkeypatch.setenv("APPLIANCE_MAX_NUM_SEQS", "x")
    result = runner.invoke(app, ["stop"])
    assert result.exit_code == 0 and "stopped" in result.output and not bg.status().running, result.output
    monkeypatch.delenv("APPLIANCE_DATA_DIR")
    (tmp_path / "config.toml").write_text(f'data_dir = "{tmp_path / "data"}"\nmax_num_seq = 8\n')
    bg.start(FAKE_SERVER)
    result = runner.invoke(app, ["uninstall", "--yes"])
    assert result.exit_code == 0 and "stopped the server and removed the background service" in _flat(result)
    assert not bg.status().running


def test_stop_waits_for_the_servers_children(bg, tmp_path):
    """The server dies at SIGTERM at once, its child (same process group) a second later: stop returns after both."""
    child = tmp_path / "child.py"
    child.write_text("import os, signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))\n"
                     "print('child', os.getpid(), flush=True)\n"
                     "time.sleep(300)\n")
    server = tmp_path / "server.py"
    server.write_text(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(child)!r}])\n"
                      "time.sleep(300)\n")
    bg.start([sys.executable, str(server)])
    assert wait_for(lambda: any(line.startswith("child ") for line in bg.log_lines(5)))
    child_pid = int(next(line for line in bg.log_lines(5) if line.startswith("child ")).split()[1])
    assert bg.stop(timeout=10) is True
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE


def test_uninstall_then_status_says_not_installed_until_started_again(bg, tmp_path):
    """`appliance uninstall` (no --purge) stops the server and keeps its config and log; `status` then says the
    service is not installed (exit 4, as `systemctl status` for a unit that does not exist), not merely stopped;
    after --purge too."""
    runner = CliRunner()
    result = runner.invoke(app, ["uninstall", "--yes"])  # nothing ever installed: said so
    assert result.exit_code == 0 and "no background service was installed" in _flat(result), result.output
    (tmp_path / "config.toml").write_text('port = 8000\n')
    pid = bg.start(FAKE_SERVER)
    assert wait_for(lambda: "fake server up" in bg.log_lines(5))
    result = runner.invoke(app, ["uninstall", "--yes"])
    assert result.exit_code == 0 and "stopped the server and removed the background service" in _flat(result)
    assert "--purge deletes them" in _flat(result)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    st = bg.status()
    assert (st.running, st.installed) == (False, False) and "fake server up" in bg.log_lines(5)
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 4 and "not installed: removed by `appliance uninstall` (the config, models and " \
        "logs were kept); `appliance install` sets it up" in _flat(result)
    from appliance.cli import doctor_checks
    [server] = [c for c in doctor_checks(tmp_path / "config.toml") if c[1].startswith("background server")]
    assert server[2] == "run `appliance install`"  # start would refuse: it was uninstalled (a trial user's loop)
    assert "not installed" in runner.invoke(app, ["status"]).output  # asking again changes nothing
    bg.start(FAKE_SERVER)
    assert (bg.status().running, bg.status().installed) == (True, True)
    assert runner.invoke(app, ["status"]).exit_code == 0
    assert bg.stop(timeout=10) is True and bg.status().installed  # a plain stop is not an uninstall
    assert runner.invoke(app, ["status"]).exit_code == 3
    result = runner.invoke(app, ["uninstall", "--yes", "--purge"])
    assert result.exit_code == 0 and not (tmp_path / "config.toml").exists() and not (tmp_path / "data").exists()
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 4 and "not installed: no config at" in _flat(result)


def test_start_after_stop_runs_serve_with_the_config(bg, tmp_path, monkeypatch):
    """`appliance start` brings a stopped background service back with `appliance serve --config` (the command the
    installer starts); it says so when it already runs, and refuses with a fix when nothing is installed."""
    runner = CliRunner()
    result = runner.invoke(app, ["start"])
    assert result.exit_code == 1 and "no config at" in _flat(result) and "appliance install" in _flat(result)
    (tmp_path / "config.toml").write_text(f'port = {_free_port()}\nmodel = "{tmp_path / "nope"}"\n')
    result = runner.invoke(app, ["start"])  # the server would exit at once, after `started` was printed
    assert result.exit_code == 1 and f"{tmp_path / 'nope'} has no config.json" in _flat(result), result.output
    model = _model(tmp_path)
    (tmp_path / "config.toml").write_text(f'port = {_free_port()}\nmodel = "{model}"\n')  # not 8000: a user's
    started = []  # own server may hold it
    real_start = service.Background.start
    monkeypatch.setattr(service.Background, "start",
                        lambda self, command: started.append(command) or real_start(self, FAKE_SERVER))
    result = runner.invoke(app, ["start"])
    assert result.exit_code == 0 and "started (background)" in _flat(result), result.output
    assert started == [[sys.executable, "-m", "appliance", "serve", "--config", str(tmp_path / "config.toml")]]
    assert wait_for(lambda: bg.status().running)
    result = runner.invoke(app, ["start"])
    assert result.exit_code == 0 and "already running (background)" in _flat(result) and len(started) == 1
    assert runner.invoke(app, ["uninstall", "--yes"]).exit_code == 0
    result = runner.invoke(app, ["start"])
    assert result.exit_code == 1 and "not installed (removed by `appliance uninstall`)" in _flat(result)
    assert "the background service was already removed" in _flat(runner.invoke(app, ["uninstall", "--yes"]))


def test_start_refuses_a_port_another_program_holds(bg, tmp_path):
    """`appliance start` checks the config's port first, as install does: a server started on a taken port would
    exit at once, after `started` was printed."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        (tmp_path / "config.toml").write_text(f'host = "127.0.0.1"\nport = {port}\nmodel = "{_model(tmp_path)}"\n')
        result = CliRunner().invoke(app, ["start"])
        (tmp_path / "config.toml").write_text(f'host = "999.1.1.1"\nport = {port}\nmodel = "{_model(tmp_path)}"\n')
        elsewhere = CliRunner().invoke(app, ["start"])  # once reported as a port in use
    assert result.exit_code == 1, result.output
    assert f"port {port} on 127.0.0.1 is already in use" in _flat(result), result.output
    assert f"set `port` in {tmp_path / 'config.toml'}" in _flat(result)
    assert elsewhere.exit_code == 1 and "cannot listen on 999.1.1.1" in _flat(elsewhere), elsewhere.output
    assert "set `host` in" in _flat(elsewhere) and "--host" not in _flat(elsewhere)
    assert not bg.status().running


def test_start_refuses_a_setting_the_engine_would_refuse(bg, tmp_path, monkeypatch):
    """A bad value (here from the environment) stops `appliance start` with the reason, instead of a server that
    exits in its log after `started` was printed."""
    (tmp_path / "config.toml").write_text(f'model = "/m"\nport = {_free_port()}\n')
    monkeypatch.setenv("APPLIANCE_DTYPE", "bf16")
    result = CliRunner().invoke(app, ["start"])
    assert result.exit_code == 1, result.output
    assert "dtype: must be auto, float32, bfloat16 or float16, got 'bf16'" in _flat(result)
    assert "change dtype in the config file, APPLIANCE_DTYPE or `appliance serve --dtype`" in _flat(result)
    assert not bg.status().running


def test_status_tells_loading_ready_and_failed_engines_apart(bg, tmp_path):
    """Behind the running process, /health decides: 503 while the engine loads ("starting", exit 0), 200
    ("running", exit 0), 503 with a dead engine ("failed", exit 1, the error shown)."""
    import threading

    from test_server_fakes import FakeEngine, ServerThread, wait_for as wait_until

    from appliance.cli import doctor_checks
    from engine.async_engine import AsyncLLMEngine
    from engine.server.api_server import build_app

    def loads(gate, fails):
        def factory():  # the engine thread loads the model until the gate opens
            gate.wait(30)
            if fails:
                raise RuntimeError("CUDA out of memory while loading")
            return FakeEngine()
        return factory

    def health_check():  # `appliance doctor`'s /health line: (ok, what, fix)
        return next(c for c in doctor_checks(tmp_path / "config.toml") if c[1].startswith("/health"))

    runner = CliRunner()
    bg.start(FAKE_SERVER)
    for fails, expect, code in ((False, "running", 0), (True, "failed", 1)):
        gate = threading.Event()
        engine = AsyncLLMEngine(loads(gate, fails), "fake-model")
        with ServerThread(build_app(engine)) as url:
            (tmp_path / "config.toml").write_text(f"port = {url.rsplit(':', 1)[1]}\n")
            loading, doctor_loading = runner.invoke(app, ["status"]), health_check()
            gate.set()
            wait_until(lambda: engine.state in ("ready", "dead"), what="engine loaded or dead")
            result, doctor = runner.invoke(app, ["status"]), health_check()
            engine.shutdown()
        assert loading.exit_code == 0 and "starting" in loading.output, loading.output
        assert "loading the model" in _flat(loading)
        assert doctor_loading[:2] == (True, f"/health on port {url.rsplit(':', 1)[1]}: loading the model")
        assert result.exit_code == code and expect in result.output, result.output
        assert doctor[0] is (not fails)
    assert "CUDA out of memory while loading" in _flat(result) and "endpoint" not in result.output
    assert "CUDA out of memory while loading" in doctor[1] and doctor[2] == installer.GPU_MEMORY_FIX


@pytest.mark.parametrize("status,body,state,detail", [
    (200, b"", "ready", "ready"),
    (503, b'{"status": "loading", "model": "m"}', "loading", "loading the model"),
    (503, b'{"status": "dead", "error": "RuntimeError()"}', "failed", "the engine stopped: RuntimeError()"),
    (503, b'{"status": "dead", "error": null}', "failed", "the engine stopped: no error given"),
    (503, b'{"error": {"code": "server_overloaded"}}', "other", "HTTP 503"),  # overloaded: not a load state
    (503, b"[1, 2]", "other", "HTTP 503"), (503, b"null", "other", "HTTP 503"), (503, b"<html>", "other", "HTTP 503"),
    (404, b'{"detail": "Not Found"}', "other", "HTTP 404")])
def test_server_health_reads_every_answer_without_raising(monkeypatch, status, body, state, detail):
    import httpx

    from appliance.installer import server_health

    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(status, content=body))
    health = server_health("http://127.0.0.1:1")
    assert (health.state, health.detail) == (state, detail)


def test_server_health_of_nothing_listening_or_a_bad_url_is_no_answer():
    from appliance.installer import server_health

    down = server_health(f"http://127.0.0.1:{_free_port()}", timeout=2)
    assert down.state == "no answer" and down.detail.startswith("ConnectError")
    assert server_health("http://[::1", timeout=2).state == "no answer"


def test_wait_healthy_gives_up_at_once_on_a_dead_engine(monkeypatch, bg):
    monkeypatch.setattr(installer, "server_health", lambda url: installer.Health("failed", "the engine stopped: x"))
    bg.start(FAKE_SERVER)
    start = time.monotonic()
    with pytest.raises(installer.ServerFailed, match="could not load the model .the engine stopped: x.") as err:
        installer.wait_healthy("http://127.0.0.1:1", bg, timeout=60)
    assert time.monotonic() - start < 5
    assert err.value.hint == f"see `appliance logs`; the log is {bg.log_file}"
    # out of GPU memory (run 124's error: CUDA says "illegal memory access" when a kernel load finds it full)
    oom = "the engine stopped: RuntimeError('Triton Error [CUDA]: an illegal memory access was encountered')"
    monkeypatch.setattr(installer, "server_health", lambda url: installer.Health("failed", oom))
    with pytest.raises(installer.ServerFailed) as err:
        installer.wait_healthy("http://127.0.0.1:1", bg, timeout=60)
    assert err.value.hint == f"{installer.GPU_MEMORY_FIX}; the log is {bg.log_file}"


@pytest.mark.parametrize("error, memory", [
    ("OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')", True),
    ("RuntimeError('Triton Error [CUDA]: out of memory')", True),
    ("RuntimeError('Triton Error [CUDA]: an illegal memory access was encountered')", True),
    ("OSError('model.safetensors: no such file')", False)])
def test_a_failed_engine_s_fix_names_gpu_memory_only_for_a_memory_error(error, memory):
    from appliance.installer import GPU_MEMORY_FIX, Health, failed_fix

    fix = failed_fix(Health("failed", f"the engine stopped: {error}"), "see `appliance logs`")
    assert fix == (GPU_MEMORY_FIX if memory else "see `appliance logs`")


def test_follow_prints_the_last_n_lines_first(bg, monkeypatch, capsys):
    """`appliance logs -n N -f`: N lines of history, then new ones (the loop ends here at its first wait)."""
    bg.state_dir.mkdir(parents=True, exist_ok=True)
    bg.log_file.write_text("".join(f"line {i}\n" for i in range(10)))

    class Waited(Exception):
        pass

    def no_wait(seconds):
        raise Waited

    monkeypatch.setattr(service.time, "sleep", no_wait)
    with pytest.raises(Waited):
        bg.follow(3)
    assert capsys.readouterr().out == "line 7\nline 8\nline 9\n"


def test_a_silent_server_is_starting_only_while_young_and_never_restarted(bg):
    from appliance.cli import _serving_state

    url = f"http://127.0.0.1:{_free_port()}"
    pid = bg.start(FAKE_SERVER)
    young = service.Status(mode="background", running=True, pid=pid)
    assert _serving_state(url, young)[0] == "starting"
    assert _serving_state(url, service.Status(mode="systemd", running=True, pid=pid, restarts=2))[0] == "restarting"
    assert _serving_state(url, service.Status(mode="systemd", running=True, pid=None))[0] == "hung"  # age unknown
    import appliance.cli as cli
    startup, cli.STARTUP_S = cli.STARTUP_S, 0.0  # old: a restart long ago does not make a hung server restarting
    try:
        assert _serving_state(url, service.Status(mode="systemd", running=True, pid=pid, restarts=1))[0] == "hung"
    finally:
        cli.STARTUP_S = startup


def test_the_cli_does_not_import_torch():
    """`appliance status`, `logs`, `--help` start in a fraction of a second: torch loads only where it computes."""
    import subprocess
    import sys

    code = "import sys, appliance.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"

"""The command line on bad input (one line, exit 1, no traceback), detect/tune output, and the installer's
model resolution and checkpoint keys."""
import contextlib
import io
import json
import os
import socket
import sys
from pathlib import Path

import pytest
from appliance_testenv import isolate
from rich.console import Console
from typer.testing import CliRunner

from appliance import config as cfgmod
from appliance import hardware, installer, service
from appliance.cli import app, doctor_checks
from appliance.errors import ApplianceError

runner = CliRunner()
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(service, "systemd_running", lambda: False)


def make_model(path, cfg=LLAMA):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"\0" * 1024)
    return path


def one_line_error(result, *needles):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "fix:" in lines[0], result.output
    for needle in needles:
        assert needle in lines[0]


def test_dash_h_is_help_everywhere():
    for argv in ([], ["serve"], ["install"]):
        result = runner.invoke(app, [*argv, "-h"])
        assert result.exit_code == 0 and "Usage: " in result.output and "No such option" not in result.output, argv


def test_install_unknown_model(tmp_path):
    one_line_error(runner.invoke(app, ["install", "no/such-model", "--yes", "--no-service"]), "not found")


def test_install_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line_error(runner.invoke(app, ["install", str(tmp_path / "empty"), "--yes"]), "no config.json")


def test_install_bad_method_and_port():
    one_line_error(runner.invoke(app, ["install", "--method", "fp3", "--yes"]), "--method")
    one_line_error(runner.invoke(app, ["install", "--port", "70000", "--yes"]), "--port")


def test_install_without_yes_and_without_terminal_asks_for_yes():
    one_line_error(runner.invoke(app, ["install"], input=""), "--yes")


def test_tune_and_serve_bad_input(tmp_path):
    one_line_error(runner.invoke(app, ["tune", str(tmp_path)]), "no config.json")
    one_line_error(runner.invoke(app, ["tune", str(make_model(tmp_path / "m")), "--max-model-len", "5000"]),
                   "over the model's limit")
    one_line_error(runner.invoke(app, ["serve", "--config", str(tmp_path / "nope.toml")]), "not found")
    one_line_error(runner.invoke(app, ["serve"]), "no model is configured")
    one_line_error(runner.invoke(app, ["quantize", str(tmp_path / "m"), "--method", "int3", "--out", "x"]), "--method")


def test_serve_refuses_in_one_line_what_would_fail_after_loading(tmp_path, monkeypatch):
    """Before the model loads (run_server is never reached): a port out of range (70000 was served on 4464) or in
    use, max_model_len over the model's context or below 1 (0 was served as "auto"), device cuda without a GPU."""
    import torch

    import engine.server.api_server as api_server
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: pytest.fail("the server started"))
    model = str(make_model(tmp_path / "m"))
    for flags, needles in [(["--port", "70000"], ["port 70000 is not between 1 and 65535", "--port 8000"]),
                           (["--port", "-1"], ["port -1 is not between"]),
                           (["--host", "999.1.1.1"], ["cannot listen on 999.1.1.1", "--host 127.0.0.1"]),
                           (["--max-model-len", "5000"], ["max_model_len: 5000 is over", "pass --max-model-len 1024"]),
                           (["--max-model-len", "0"], ["max_model_len: must be at least 1, got 0"])]:
        one_line_error(runner.invoke(app, ["serve", model, *flags]), *needles)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_line_error(runner.invoke(app, ["serve", model, "--device", "cuda"]), "torch sees no CUDA GPU", "--device cpu")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        one_line_error(runner.invoke(app, ["serve", model, "--port", str(port)]), f"port {port} on 127.0.0.1 is "
                       "already in use")


def test_bad_env_variable_is_one_line(monkeypatch):
    monkeypatch.setenv("APPLIANCE_PORT", "http")
    one_line_error(runner.invoke(app, ["status"]), "APPLIANCE_PORT")


def test_detect_json():
    result = runner.invoke(app, ["detect", "--json"])
    assert result.exit_code == 0
    hw = json.loads(result.output)
    host = hardware.host()
    assert hw["kind"] in ("cpu", "cuda") and (hw["cpu_cores"], hw["total_memory"]) == (host["cpu_cores"],
                                                                                      host["total_memory"])
    assert (hw["kind"] == "cpu") == (hw["gpus"] == [])
    assert hw["cpu_bf16"] is hardware.host()["cpu_bf16"]


@pytest.mark.parametrize("dtype,element", [("float32", 4), ("bfloat16", 2)])
def test_tune_json_uses_flags(tmp_path, monkeypatch, dtype, element):
    cpu = hardware.Hardware(kind="cpu", cpu_cores=2, total_memory=8 << 30, available_memory=6 << 30, reason="test")
    monkeypatch.setattr(hardware, "detect", lambda: cpu)  # a GPU host refuses float32 (tuner.check_flags)
    result = runner.invoke(app, ["tune", str(make_model(tmp_path / "m")), "--json", "--max-num-seqs", "3",
                                 "--max-model-len", "512", "--dtype", dtype])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert (plan["max_num_seqs"], plan["max_model_len"], plan["kv_bytes_per_token"], plan["dtype"]) == \
        (3, 512, 2 * 2 * 2 * 16 * element, dtype)
    assert plan["reasons"]["max_num_seqs"] == "set by --max-num-seqs"
    assert plan["reasons"]["dtype"] == "set by --dtype"
    one_line_error(runner.invoke(app, ["tune"]), "no model to plan for: none is installed", "give MODEL_DIR")
    cfgmod.save(cfgmod.Config(model=str(tmp_path / "m")), cfgmod.config_path())  # installed: no MODEL_DIR needed
    installed = runner.invoke(app, ["tune", "--json", "--max-num-seqs", "3", "--max-model-len", "512",
                                    "--dtype", dtype])
    assert installed.exit_code == 0 and json.loads(installed.output) == plan, installed.output
    other = cfgmod.save(cfgmod.Config(model=str(tmp_path / "m")), tmp_path / "other.toml")
    cfgmod.config_path().unlink()
    given = runner.invoke(app, ["tune", "--config", str(other), "--json", "--max-num-seqs", "3", "--max-model-len",
                                "512", "--dtype", dtype])
    assert given.exit_code == 0 and json.loads(given.output) == plan, given.output


def test_doctor_flags_a_bfloat16_config_on_a_cpu_without_bfloat16_instructions(tmp_path, monkeypatch):
    """An install chose bfloat16 on another CPU (a moved image, a migrated VM): doctor names it and the fix."""
    model = make_model(tmp_path / "m")
    conf_path = cfgmod.save(cfgmod.Config(model=str(model), dtype="bfloat16", device="cpu"), tmp_path / "c.toml")
    for bf16 in (True, False):
        hw = hardware.Hardware(kind="cpu", cpu_cores=2, total_memory=8 << 30, available_memory=6 << 30,
                               cpu_bf16=bf16, reason="test")
        monkeypatch.setattr(hardware, "detect", lambda hw=hw: hw)
        [check] = [c for c in doctor_checks(conf_path) if c[1].startswith("dtype bfloat16")]
        assert check[0] is bf16 and ("without bfloat16 instructions" in check[1]) is not bf16
        assert 'dtype = "float32"' in check[2]
    cfgmod.save(cfgmod.Config(model=str(model), device="cpu"), conf_path)  # float32 ("auto"): nothing to say
    assert not [c for c in doctor_checks(conf_path) if c[1].startswith("dtype")]
    monkeypatch.setenv("APPLIANCE_DTYPE", "bf16")  # a value the engine refuses: named, with the fix
    [bad] = [c for c in doctor_checks(conf_path) if "must be auto, float32" in c[1]]
    assert bad[0] is False and bad[2] == "change dtype in the config file, APPLIANCE_DTYPE or `appliance serve --dtype`"


def test_install_refuses_a_bad_dtype_before_looking_at_the_model(monkeypatch):
    """No minutes of demo conversion before the flag's error."""
    monkeypatch.setattr(installer, "resolve_model", lambda *a, **k: pytest.fail("resolved the model first"))
    one_line_error(runner.invoke(app, ["install", "--yes", "--no-service", "--dtype", "bf16"]),
                   "--dtype must be auto, float32, bfloat16 or float16, got 'bf16'")
    one_line_error(runner.invoke(app, ["install", "--yes", "--no-service", "--kv-cache-dtype", "fp4"]),
                   "--kv-cache-dtype must be auto, fp8 or int8")


def test_install_refuses_an_address_it_cannot_listen_on_before_anything_changes(monkeypatch, tmp_path):
    """A port another program holds, or a host that is not this machine's: one line before the model is even
    looked at (the running server and the config stay as they were); a port the server of an earlier install
    holds is fine (that server is stopped before the new one starts)."""
    monkeypatch.setattr(installer, "resolve_model", lambda *a, **k: pytest.fail("resolved the model first"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        one_line_error(runner.invoke(app, ["install", "--yes", "--no-service", "--port", str(port)]),
                       f"port {port} on 127.0.0.1 is already in use", f"--port {port + 1}")
        one_line_error(runner.invoke(app, ["install", "--yes", "--no-service", "--host", "999.1.1.1"]),
                       "cannot listen on 999.1.1.1:8000", "--host 127.0.0.1")
        assert not (tmp_path / "config.toml").exists()
        ours = service.Status(mode="background", running=True, pid=os.getpid())  # this process holds the port
        monkeypatch.setattr(service.Background, "status", lambda self: ours)
        installer.check_address("127.0.0.1", port, tmp_path / "data")
        monkeypatch.setattr(service.Background, "status", lambda self: service.Status("background", False))
        with pytest.raises(ApplianceError, match="already in use"):
            installer.check_address("127.0.0.1", port, tmp_path / "data")


def test_version_and_the_questions_asked_without_a_terminal(monkeypatch):
    """--version, as vllm's and ollama's; install without --yes and without a terminal to ask on says so before
    anything (it asked first after minutes of perplexity passes)."""
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"appliance {version('edge-appliance')}\n"
    monkeypatch.setattr(installer, "resolve_model", lambda *a, **k: pytest.fail("resolved the model first"))
    one_line_error(runner.invoke(app, ["install", "/some/model"]), "no terminal to ask on", "--yes")
    one_line_error(runner.invoke(app, ["install", "--yes", "--eval-tokens", "0"]), "--eval-tokens must be at least 2")


def test_doctor_reports_missing_config(tmp_path):
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1
    flat = " ".join(result.output.split())
    assert f"FAIL config {tmp_path / 'config.toml'} is missing (fix: run `appliance install`)" in flat
    assert "FAIL no model configured (fix: run `appliance install`)" in flat
    assert "appliance start" not in result.output  # never installed: nothing to start


def test_doctor_names_a_model_the_engine_would_not_load_and_a_port_out_of_range(tmp_path):
    """Each is one failed check among the others (a TuneError, an OverflowError from bind, ended doctor before)."""
    model = make_model(tmp_path / "m", {**LLAMA, "quantization_config": {**AWQ4, "bits": 3}})
    conf_path = cfgmod.save(cfgmod.Config(model=str(model), device="cpu", port=70000), tmp_path / "c.toml")
    checks = doctor_checks(conf_path)
    [bad_model] = [c for c in checks if c[1].startswith(f"model {model}")]
    assert bad_model[0] is False and "awq with 3-bit weights is not supported" in bad_model[1]
    [bad_port] = [c for c in checks if "70000" in c[1]]
    assert bad_port[0] is False and "port 70000 is not between 1 and 65535" in bad_port[1]


def test_resolve_model_folder_and_hf_cache(tmp_path):
    console = Console(quiet=True)
    folder = make_model(tmp_path / "MyModel")
    assert installer.resolve_model(str(folder), console) == (folder.resolve(), "MyModel")
    repo = tmp_path / "hub" / "models--org--Tiny"
    make_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert installer.resolve_model("org/Tiny", console) == (repo / "snapshots" / "abc123", "org/Tiny")
    with pytest.raises(ApplianceError, match="not found"):
        installer.resolve_model("org/Other", console)


def test_install_refuses_an_architecture_the_engine_does_not_serve_before_quantizing(tmp_path):
    folder = make_model(tmp_path / "Gemma-Tiny", {**LLAMA, "architectures": ["Gemma2ForCausalLM"]})
    one_line_error(runner.invoke(app, ["install", str(folder), "--yes", "--no-service"]), "Gemma2ForCausalLM",
                   "not supported", "Qwen2")
    assert installer.resolve_model(str(folder), Console(quiet=True))[1] == "Gemma-Tiny"  # `quantize` takes it
    sliding = make_model(tmp_path / "Qwen2-Sliding", {**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                                     "use_sliding_window": True})
    one_line_error(runner.invoke(app, ["install", str(sliding), "--yes", "--no-service"]), "sliding-window")
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*-awq-*"))  # nothing quantized


def test_install_checks_the_architecture_before_the_weights(tmp_path):
    """An unsupported model without safetensors weights: the refusal names the architecture (converting the
    weights would not help), and a supported one without weights is told to convert them."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["GPT2LMHeadModel"]}))
    one_line_error(runner.invoke(app, ["install", str(folder), "--yes", "--no-service"]), "GPT2LMHeadModel",
                   "not supported")
    (folder / "config.json").write_text(json.dumps(LLAMA))
    one_line_error(runner.invoke(app, ["install", str(folder), "--yes", "--no-service"]), "no *.safetensors",
                   "convert the model to safetensors")


AWQ4 = {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True}


@pytest.mark.parametrize("config, needles", [
    ({**LLAMA, "quantization_config": {**AWQ4, "bits": 3}}, ["awq with 3-bit weights is not supported", "bits: 4"]),
    ({**LLAMA, "quantization_config": {**AWQ4, "bits": 8}}, ["awq with 8-bit weights"]),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 64}},
     ["gptq with 3-bit weights", "bits: 2, 4, 8"]),
    ({**LLAMA, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     ["quant_method 'bitsandbytes' is not supported"]),
    ({**LLAMA, "quantization_config": {**AWQ4, "version": "gemv"}}, ["AWQ version 'gemv' is not supported"]),
    ([1, 2, 3], ["config.json is not a JSON object"]),
    ("{not json", ["config.json is not readable JSON"]),
])
def test_install_and_tune_refuse_a_model_the_engine_cannot_load_in_one_line(tmp_path, config, needles):
    """What the engine would refuse at load (its quantization, a config.json that is not an object) is refused by
    install (before anything is quantized or measured) and tune, in one line: no traceback, no plan."""
    folder = make_model(tmp_path / "model")
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    one_line_error(runner.invoke(app, ["install", str(folder), "--yes", "--no-service"]), *needles)
    one_line_error(runner.invoke(app, ["tune", str(folder)]), *needles)
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*-awq-*"))


def test_an_empty_quantization_config_is_dense_and_a_malformed_one_a_checkpoint_error():
    from engine.models.checkpoint_config import CheckpointError, check_quantization
    check_quantization({**LLAMA, "quantization_config": {}})  # as the installer and the planner read it
    for bad in ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": []},
                {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"g": {"weights": None}}}):
        with pytest.raises(CheckpointError, match="quantization_config: "):
            check_quantization({**LLAMA, "quantization_config": bad})


def test_urls_as_users_paste_them(tmp_path):
    """No scheme (it was "no server answers ... start it"), the OpenAI base URL, an endpoint's whole address (it
    was a 404 on .../chat/completions/v1/models); with nothing installed the fix says install, not start."""
    from appliance.cli import _base_url

    assert _base_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert _base_url("http://h:1/v1/") == _base_url(" http://h:1 ") == "http://h:1"
    with pytest.raises(ApplianceError, match="is an endpoint's address") as err:
        _base_url("http://h:1/v1/chat/completions")
    assert err.value.hint == "give the server's base URL: --url http://h:1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing answers there
    one_line_error(runner.invoke(app, ["chat", "--url", f"127.0.0.1:{port}", "hi"]),
                   f"no server answers at http://127.0.0.1:{port}", "install and start it with `appliance install`")


def test_no_server_at_another_address_than_the_installed_ones_says_to_check_the_url(tmp_path, monkeypatch):
    """`chat --url localhost:9999` with a server installed on 8000 said to run `appliance start` (which starts the
    one on 8000)."""
    from types import SimpleNamespace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing answers there
    monkeypatch.setattr("appliance.cli._manager", lambda conf: SimpleNamespace(
        status=lambda: SimpleNamespace(installed=True, running=False)))
    cfgmod.save(cfgmod.Config(model=str(make_model(tmp_path / "m")), port=port + 1))
    one_line_error(runner.invoke(app, ["chat", "--url", f"127.0.0.1:{port}", "hi"]),
                   f"no server answers at http://127.0.0.1:{port}",
                   f"check --url (the installed server's address is http://127.0.0.1:{port + 1})")
    cfgmod.save(cfgmod.Config(model=str(make_model(tmp_path / "m")), port=port))
    for url in (f"127.0.0.1:{port}", f"http://localhost:{port}/v1/"):  # the installed server's, however spelt
        one_line_error(runner.invoke(app, ["chat", "--url", url, "hi"]),
                       "start it with `appliance start`, or pass --url")


def test_the_installed_server_however_spelt_gets_its_key_and_its_starting_state(tmp_path, monkeypatch):
    """`--url localhost:8000` for a server installed on 127.0.0.1:8000 got neither the installed API key (a 401)
    nor the "starting" wait (the URL strings differ); another port, or another host, gets neither still."""
    from types import SimpleNamespace

    from appliance.cli import _installed_starting, _server

    cfgmod.save(cfgmod.Config(model=str(make_model(tmp_path / "m")), port=8000, api_key="k1"))
    monkeypatch.setattr("appliance.cli._manager", lambda conf: SimpleNamespace(
        status=lambda: SimpleNamespace(installed=True, running=True)))
    monkeypatch.setattr("appliance.cli._serving_state", lambda url, st, health: ("starting", ""))
    for url in ("localhost:8000", "http://[::1]:8000/v1", "127.0.0.1:8000"):
        assert _server(url, None) == (_base_url_of(url), "k1")
        assert _installed_starting(_base_url_of(url), None)
    for url in ("localhost:8001", "http://example.com:8000"):
        assert _server(url, None) == (_base_url_of(url), None)
        assert not _installed_starting(_base_url_of(url), None)
    assert _server("localhost:8000", "mine") == ("http://localhost:8000", "mine")


def _base_url_of(url: str) -> str:
    from appliance.cli import _base_url

    return _base_url(url).rstrip("/")


def test_an_error_holding_brackets_is_printed_as_it_is(capsys):
    """A server's message such as "[/v1]" was read as Rich markup: a MarkupError traceback, or words gone."""
    from appliance.cli import friendly

    def fails():
        raise ApplianceError("the server said [/v1] and [INST]", "see [bold]")
    import typer

    with pytest.raises(typer.Exit) as exit_:
        friendly(fails)()
    assert exit_.value.exit_code == 1
    assert "error: the server said [/v1] and [INST] (fix: see [bold])" in " ".join(capsys.readouterr().err.split())


def test_ctrl_c_after_gptqmodel_was_loaded_exits_130_at_once(capsys, monkeypatch):
    """gptqmodel's worker threads made the normal exit after Ctrl-C abort (status 134): with it loaded, the exit
    is immediate; without it, the usual typer.Exit(130)."""
    import typer

    from appliance.cli import friendly

    def interrupted():
        raise KeyboardInterrupt

    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code) or sys.exit(code))
    monkeypatch.delitem(sys.modules, "gptqmodel", raising=False)
    with pytest.raises(typer.Exit) as exit_:
        friendly(interrupted)()
    assert (exit_.value.exit_code, exits) == (130, [])
    monkeypatch.setitem(sys.modules, "gptqmodel", object())
    with pytest.raises(SystemExit) as exit_:
        friendly(interrupted)()
    assert (exit_.value.code, exits) == (130, [130])
    assert capsys.readouterr().err.split() == ["interrupted", "interrupted"]


def test_tune_refuses_an_architecture_or_a_folder_without_weights(tmp_path):
    folder = make_model(tmp_path / "gpt2", {**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    one_line_error(runner.invoke(app, ["tune", str(folder)]), "GPT2LMHeadModel", "not supported")
    (folder / "config.json").write_text(json.dumps(LLAMA))
    assert runner.invoke(app, ["tune", str(folder)]).exit_code == 0
    (folder / "model.safetensors").unlink()
    one_line_error(runner.invoke(app, ["tune", str(folder)]), "no *.safetensors")


@pytest.mark.parametrize("flag, value, needle", [
    ("--kv-cache-dtype", "fp16", "--kv-cache-dtype must be auto, fp8 or int8"),
    ("--dtype", "bf16", "--dtype must be auto, float32, bfloat16 or float16, got 'bf16'"),
    ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization must be in (0, 1]"),
    ("--max-num-seqs", "0", "--max-num-seqs must be at least 1"),
    ("--max-model-len", "4096", "--max-model-len 4096 is over the model's limit of 1024 tokens"),
])
def test_install_refuses_a_bad_flag_before_quantizing(tmp_path, monkeypatch, flag, value, needle):
    monkeypatch.setattr(installer, "quantize_model", lambda *a, **k: pytest.fail("quantized before the flags"))
    folder = make_model(tmp_path / "Tiny")
    one_line_error(runner.invoke(app, ["install", str(folder), "--yes", "--no-service", flag, value]), needle)


def test_checkpoint_dir_is_keyed_by_source_method_and_group(tmp_path):
    a, b = make_model(tmp_path / "a"), make_model(tmp_path / "b")
    key = installer.checkpoint_dir(tmp_path, a, "a", "awq", 4, 128)
    assert key == installer.checkpoint_dir(tmp_path, a, "a", "awq", 4, 128)
    assert key.name.startswith("a-awq-w4g128-")
    others = {installer.checkpoint_dir(tmp_path, b, "a", "awq", 4, 128),
              installer.checkpoint_dir(tmp_path, a, "a", "gptq", 4, 128),
              installer.checkpoint_dir(tmp_path, a, "a", "awq", 4, 64)}
    assert key not in others and len(others) == 3
    org = installer.checkpoint_dir(tmp_path, a, "org/a", "awq", 4, 128)
    assert org.parent == key.parent and org.name.startswith("org--a-awq-w4g128-")
    key.mkdir(parents=True)  # what an install of "org/a" made before its folders were named org--a
    assert installer.checkpoint_dir(tmp_path, a, "org/a", "awq", 4, 128) == key


def test_quantize_refuses_bad_input_in_one_line_before_any_work(tmp_path, monkeypatch):
    """Tracebacks once (ZeroDivisionError, NotADirectoryError, transformers' OSError, gptqmodel's refusal of a
    quantized model), or a flag that did nothing (--desc-act with AWQ ran a whole AWQ quantization)."""
    monkeypatch.setattr(installer, "quantize_model", lambda *a, **k: pytest.fail("quantized"))
    model = make_model(tmp_path / "m")
    (tmp_path / "afile").write_text("x")
    for flags, needles in [(["--group-size", "0"], ["--group-size must be -1 (per channel) or a power of two"]),
                           (["--group-size", "96"], ["got 96"]), (["--bits", "3"], ["--bits 3 is not supported"]),
                           (["--bits", "8"], ["AWQ takes 4"]), (["--desc-act"], ["--desc-act is GPTQ's act-order"]),
                           (["--out", str(tmp_path / "afile")], ["is not an empty folder"])]:
        argv = ["quantize", str(model), "--out", str(tmp_path / "out"), *flags]
        one_line_error(runner.invoke(app, argv), *needles)
    (model / "config.json").write_text("{not json")
    one_line_error(runner.invoke(app, ["quantize", str(model), "--out", str(tmp_path / "out")]), "not readable JSON")
    (model / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": {"quant_method": "awq"}}))
    one_line_error(runner.invoke(app, ["quantize", str(model), "--out", str(tmp_path / "out")]),
                   "is quantized already (awq)", "appliance install")


def test_quantize_reuses_the_unquantized_perplexity_and_logs_the_quantizers_output(tmp_path, monkeypatch):
    """The unquantized model's perplexity (2-3 minutes here) was measured again on every run, and gptqmodel's
    5,000 lines of output on the screen buried the table."""
    import quant.evaluate

    model = make_model(tmp_path / "m")
    log = cfgmod.data_dir() / "run" / "quantize.log"
    monkeypatch.setattr("quant.quantize.fit_group_size", lambda source, group_size: 64)
    monkeypatch.setattr(installer, "output_to", lambda path, console: contextlib.nullcontext())  # CliRunner's fds

    def quantize_model(source, out, *args, log=None, **kwargs):
        assert log == cfgmod.data_dir() / "run" / "quantize.log"
        return make_model(out)
    monkeypatch.setattr(installer, "quantize_model", quantize_model)
    measured = []
    monkeypatch.setattr(quant.evaluate, "perplexity",
                        lambda path, max_tokens: measured.append(Path(path).name) or 10.0 + len(measured))
    for out in ("q1", "q2"):
        result = runner.invoke(app, ["quantize", str(model), "--out", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
    assert measured == ["m", "q1", "q2"]
    assert f"the quantizer's own output: {log}" in " ".join(result.output.split())
    assert "11.000" in result.output and "13.000" in result.output  # the first run's unquantized figure
    assert "Group size 128 does not divide m's layer widths: using 64" in result.output  # as install says it
    assert "AWQ 4-bit g64" in result.output


def test_already_quantized_checkpoint_is_detected(tmp_path):
    plain = make_model(tmp_path / "plain")
    quantized = make_model(tmp_path / "q", {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert installer.existing_quantization(plain) is None
    assert installer.existing_quantization(quantized) == "gptq"


def test_usage_text_has_url_model_curl_and_sdk():
    text = installer.usage_text("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", "k1")
    assert "http://127.0.0.1:8000/v1" in text and "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert "Authorization: Bearer k1" in text and 'OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="k1")' in text
    # no chat that runs to the context's end; the answers repeatable
    assert '"max_tokens": 128, "temperature": 0,' in text and "max_tokens=128, temperature=0," in text
    assert installer.client_url("0.0.0.0", 9000) == "http://127.0.0.1:9000"


def test_serve_passes_swap_space_to_the_engine(tmp_path, monkeypatch):
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(config))
    model = str(make_model(tmp_path / "m"))
    result = runner.invoke(app, ["serve", model, "--swap-space", "3"])
    assert result.exit_code == 0, result.output
    assert [(c.model, c.swap_space) for c in started] == [(model, 3.0)]
    one_line_error(runner.invoke(app, ["serve", model, "--swap-space", "-1"]), "swap_space: must be at least 0 GiB")


def test_serve_model_dir_is_served_under_its_own_name(tmp_path, monkeypatch):
    """`serve OTHER_DIR` beside an install served that folder under the installed model's name (two models, one
    name); a folder that does not exist was "has no config.json (fix: run `appliance install` again)"."""
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(config))
    installed, other = make_model(tmp_path / "installed"), make_model(tmp_path / "other")
    cfgmod.save(cfgmod.Config(model=str(installed), served_model_name="org/Installed"))
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert runner.invoke(app, ["serve", str(other)]).exit_code == 0
    assert [(c.model, c.served_model_name) for c in started] == [(str(installed), "org/Installed"), (str(other), None)]
    assert runner.invoke(app, ["serve", str(installed)]).exit_code == 0  # the installed folder keeps its name
    monkeypatch.setenv("APPLIANCE_SERVED_MODEL_NAME", "mine")  # a name asked for is kept
    assert runner.invoke(app, ["serve", str(other)]).exit_code == 0
    assert [c.served_model_name for c in started[2:]] == ["org/Installed", "mine"]
    one_line_error(runner.invoke(app, ["serve", str(tmp_path / "nope")]), f"model folder {tmp_path / 'nope'} not found",
                   "give a Hugging Face model folder")
    one_line_error(runner.invoke(app, ["serve", str(other / "model.safetensors")]), "is not a folder")


def test_serve_passes_the_dtype_to_the_engine(tmp_path, monkeypatch):
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(config))
    model = str(make_model(tmp_path / "m"))
    assert runner.invoke(app, ["serve", model, "--dtype", "bfloat16"]).exit_code == 0
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert [c.dtype for c in started] == ["bfloat16", "auto"]
    one_line_error(runner.invoke(app, ["serve", model, "--dtype", "half"]),
                   "dtype: must be auto, float32, bfloat16 or float16, got 'half'")


def test_serve_passes_the_step_budget_to_the_engine(tmp_path, monkeypatch):
    """max_num_batched_tokens (the config key `install --max-num-batched-tokens` writes): the config's, the flag's,
    the engine's default when neither; one below max_num_seqs is the engine's one-line error."""
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(config))
    model = str(make_model(tmp_path / "m"))
    cfgmod.save(cfgmod.Config(model=model, max_num_batched_tokens=256, max_num_seqs=7))
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert runner.invoke(app, ["serve", "--max-num-batched-tokens", "512"]).exit_code == 0
    cfgmod.save(cfgmod.Config(model=model))
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert [(c.max_num_batched_tokens, c.token_budget(4096)) for c in started] == [(256, 256), (512, 512),
                                                                                    (None, 2048)]
    one_line_error(runner.invoke(app, ["serve", "--max-num-batched-tokens", "8", "--max-num-seqs", "16"]),
                   "max_num_batched_tokens: 8 is smaller than max_num_seqs=16")


def test_serve_numbers_gpus_as_nvml_does(tmp_path, monkeypatch):
    """appliance detect and the tuner see GPUs in PCI bus order (NVML); CUDA's default is fastest first, so the
    server asks CUDA for bus order before the engine starts CUDA, unless the environment already chose."""
    from engine.server import api_server

    order = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: order.append(os.environ["CUDA_DEVICE_ORDER"]))
    model = str(make_model(tmp_path / "m"))
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert order == ["PCI_BUS_ID", "FASTEST_FIRST"]


@pytest.mark.parametrize("key, flag, given, env, fault, error", [
    ("max_waiting", "7", 7, "9", "-1", "max_waiting: must be at least 0"),
    ("allowed_origins", "*", "*", "", "[1]", "allowed_origins: a JSON list must hold origins as strings"),
])
def test_serve_passes_server_settings_to_the_server(tmp_path, monkeypatch, key, flag, given, env, fault, error):
    """The default, then the flag, then ``APPLIANCE_<KEY>`` reach ``run_server``; a bad value is a one-line error."""
    from engine.async_engine import DEFAULT_MAX_WAITING
    from engine.server import api_server
    from engine.server.cors import LOCAL_ORIGINS

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(kw[key]))
    model, option = str(make_model(tmp_path / "m")), "--" + key.replace("_", "-")
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert runner.invoke(app, ["serve", model, option, flag]).exit_code == 0
    monkeypatch.setenv("APPLIANCE_" + key.upper(), env)
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    default = {"max_waiting": DEFAULT_MAX_WAITING, "allowed_origins": LOCAL_ORIGINS}[key]
    assert started == [default, given, type(given)(env)] and DEFAULT_MAX_WAITING == 512
    one_line_error(runner.invoke(app, ["serve", model, option, fault]), error,
                   f"(fix: change {key} in the config file, APPLIANCE_{key.upper()} or `appliance serve {option}`")


def test_serve_exits_on_engine_death_unless_kept_alive(tmp_path, monkeypatch):
    """``keep_alive_on_engine_death``: False by default, then the flag's two forms, then the variable."""
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(kw["keep_alive_on_engine_death"]))
    model = str(make_model(tmp_path / "m"))
    for extra in ([], ["--keep-alive-on-engine-death"], ["--exit-on-engine-death"]):
        assert runner.invoke(app, ["serve", model, *extra]).exit_code == 0
    monkeypatch.setenv("APPLIANCE_KEEP_ALIVE_ON_ENGINE_DEATH", "true")
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert runner.invoke(app, ["serve", model, "--exit-on-engine-death"]).exit_code == 0
    assert started == [False, True, False, True, False]


def test_serve_passes_sleep_after_idle_from_flag_config_or_variable(tmp_path, monkeypatch):
    """``sleep_after_idle_s``: None (never) by default, then the flag, then the variable ("none" is never again);
    a negative one is a one-line error."""
    from engine.server import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, **kw: started.append(kw["sleep_after_idle_s"]))
    model = str(make_model(tmp_path / "m"))
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert runner.invoke(app, ["serve", model, "--sleep-after-idle", "300"]).exit_code == 0
    monkeypatch.setenv("APPLIANCE_SLEEP_AFTER_IDLE_S", "60")
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    monkeypatch.setenv("APPLIANCE_SLEEP_AFTER_IDLE_S", "none")
    assert runner.invoke(app, ["serve", model]).exit_code == 0
    assert started == [None, 300.0, 60.0, None]
    one_line_error(runner.invoke(app, ["serve", model, "--sleep-after-idle", "-1"]),
                   "sleep_after_idle_s: must be at least 0 seconds, got -1.0")


@pytest.mark.parametrize("root", [False, True])
def test_background_install_removes_the_unit_of_an_earlier_install(monkeypatch, tmp_path, root):
    """`install --no-service` where an earlier install of the same kind (system-wide as root, else the user's) left
    the systemd unit: that unit is disabled and removed, so that `status`, `stop`, `logs` (service.manager) and the
    next boot mean the background server; the other kind's unit is not this user's to remove."""
    calls = tmp_path / "systemctl.calls"
    fake = tmp_path / "bin" / "systemctl"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$2" = is-active ] && echo inactive\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(service, "systemd_running", lambda: True)
    monkeypatch.setattr(installer.cfgmod, "is_root", lambda: root)
    monkeypatch.setattr(service.Systemd, "unit_path", property(  # never the machine's own /etc/systemd
        lambda self: tmp_path / ("user" if self.user else "system") / service.UNIT_NAME))
    mine, other = service.Systemd(user=not root), service.Systemd(user=root)
    for unit in (mine, other):
        unit.unit_path.parent.mkdir(parents=True)
        unit.unit_path.write_text("[Unit]\n")
    started = []
    monkeypatch.setattr(service.Background, "start", lambda self, command: started.append(command) or 4242)
    opts = installer.InstallOptions(no_service=True, port=installer_free_port())
    mgr = installer.start_service(opts, Console(file=io.StringIO()), use_systemd=False, system=False,
                                  config_file=tmp_path / "config.toml", data_dir=tmp_path / "data")
    disable = f"{'' if root else '--user '}disable --now appliance.service"
    assert not mine.installed() and other.installed() and disable in calls.read_text().splitlines()
    assert isinstance(mgr, service.Background)
    assert started == [[sys.executable, "-m", "appliance", "serve", "--config", str(tmp_path / "config.toml")]]


def installer_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_package_that_shadows_our_kernels_stops_install_serve_and_doctor_with_the_fix(monkeypatch, tmp_path):
    """The Hugging Face ``kernels`` package (transformers >= 5.25 needs it) shares our kernels/ package's import
    name; install and serve refuse to start on it, doctor names it. Here neither is the case, as checked first."""
    import importlib.metadata
    import importlib.util
    from types import SimpleNamespace

    from appliance import environment

    assert environment.kernels_clash() is None  # this environment: ours is the one imported
    real_version = importlib.metadata.version

    def version(name):
        return "0.11.0" if name == "kernels" else real_version(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert environment.kernels_clash() == "the Hugging Face `kernels` package 0.11.0 is installed"
    for args in (["install", "--yes", "--no-service"], ["serve"]):
        one_line_error(runner.invoke(app, args), "the Hugging Face `kernels` package 0.11.0 is installed",
                       "pip uninstall -y kernels")
    doctor = runner.invoke(app, ["doctor"])
    assert doctor.exit_code == 1 and "FAIL Python packages: the Hugging Face `kernels`" in doctor.output
    monkeypatch.setattr(importlib.metadata, "version", real_version)
    elsewhere = SimpleNamespace(origin=str(tmp_path / "site" / "kernels" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: elsewhere if name == "kernels" else None)
    assert environment.kernels_clash().startswith(f"`import kernels` finds {tmp_path / 'site' / 'kernels'}")


def test_chat_and_bench_name_the_memory_fix_for_an_engine_out_of_gpu_memory(monkeypatch):
    """A server whose engine stopped: the fix is `appliance logs`, or for a CUDA memory error a plan with less."""
    from appliance import cli

    for error, fix in (("OutOfMemoryError('CUDA out of memory')", installer.GPU_MEMORY_FIX),
                       ("OSError('gone')", "see `appliance logs`")):
        health = installer.Health("failed", f"the engine stopped: {error}")
        monkeypatch.setattr(installer, "server_health", lambda url, health=health: health)
        with pytest.raises(ApplianceError, match="cannot serve: the engine stopped") as err:
            cli._check_serving("http://127.0.0.1:1", "chat")
        assert err.value.hint == fix

"""``python -m engine.server`` options: every EngineConfig field, bools with a --no- form (vLLM's)."""
from __future__ import annotations

import argparse

import pytest

from engine.server.__main__ import _engine_options


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    _engine_options(parser)
    return vars(parser.parse_args(["--model", "/m", *argv]))


def test_defaults_are_the_engine_configs():
    args = parse()
    assert args["enable_prefix_caching"] is True and args["enable_chunked_prefill"] is True
    assert args["enforce_eager"] is False and args["max_num_seqs"] == 64 and args["swap_space"] == 0.0


def test_true_by_default_flags_can_be_turned_off_and_others_on():
    args = parse("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager",
                 "--max-num-batched-tokens", "512", "--swap-space", "2.5")
    assert args["enable_prefix_caching"] is False and args["enable_chunked_prefill"] is False
    assert args["enforce_eager"] is True and args["max_num_batched_tokens"] == 512 and args["swap_space"] == 2.5


def test_every_option_has_the_config_docstrings_help():
    import dataclasses

    from engine.config import EngineConfig, field_docs

    docs = field_docs(EngineConfig)
    assert set(docs) >= {f.name for f in dataclasses.fields(EngineConfig)}
    assert docs["block_size"] == "tokens per KV cache block."
    parser = argparse.ArgumentParser()
    _engine_options(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["tune_kernels"].startswith("on CUDA, time the W4A16 kernel plans of the model's 4-bit products")
    assert "``" not in helps["model"] and "quantization_config" in helps["model"]
    assert "in (0, 1]; as in vLLM V1" in helps["gpu_memory_utilization"]  # the whole entry, past its first line
    assert helps["gpu_memory_utilization"].endswith("no more than is free when it starts.")
    parser.format_help()  # no stray % in the texts
    args = parse("--no-tune-kernels", "--kernel-plans-dir", "/tmp/p")
    assert args["tune_kernels"] is False and args["kernel_plans_dir"] == "/tmp/p"


def test_main_passes_allowed_origins_and_refuses_a_bad_list(monkeypatch, capsys):
    import pytest

    from engine.server import __main__ as server_main
    from engine.server.cors import LOCAL_ORIGINS

    started = []
    monkeypatch.setattr(server_main, "run_server", lambda config, **kw: started.append(kw["allowed_origins"]))
    server_main.main(["--model", "/m"])
    server_main.main(["--model", "/m", "--allowed-origins", "*"])
    assert started == [LOCAL_ORIGINS, "*"]
    with pytest.raises(SystemExit):
        server_main.main(["--model", "/m", "--allowed-origins", "[oops"])
    assert "allowed_origins: not a JSON list" in capsys.readouterr().err


def test_main_passes_keep_alive_on_engine_death(monkeypatch):
    from engine.server import __main__ as server_main

    started = []
    monkeypatch.setattr(server_main, "run_server",
                        lambda config, **kw: started.append(kw["keep_alive_on_engine_death"]))
    server_main.main(["--model", "/m"])
    server_main.main(["--model", "/m", "--keep-alive-on-engine-death"])
    assert started == [False, True]


def test_main_passes_sleep_after_idle(monkeypatch, capsys):
    from engine.server import __main__ as server_main

    started = []
    monkeypatch.setattr(server_main, "run_server", lambda config, **kw: started.append(kw["sleep_after_idle_s"]))
    server_main.main(["--model", "/m"])
    server_main.main(["--model", "/m", "--sleep-after-idle", "2.5"])
    with pytest.raises(SystemExit):
        server_main.main(["--model", "/m", "--sleep-after-idle", "-3"])
    assert started == [None, 2.5] and "--sleep-after-idle: must be at least 0 seconds" in capsys.readouterr().err

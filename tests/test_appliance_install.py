"""`appliance install --yes --no-service` end to end in a temporary HOME, on the bundled demo model: conversion
(reused from the shared cache), AWQ quantization, perplexities, detection, tuning, config, background server,
first answer; then the OpenAI SDK against it, a rerun that reuses everything, and status/stop."""
import os
import re
import socket
import subprocess
import sys

import pytest

from appliance import config as cfgmod
from appliance import demo_model, hardware


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ppl_rows(output: str) -> dict[str, float]:
    rows = re.finditer(r"│ (unquantized|AWQ 4-bit g\d+)\s*│\s*([\d.]+) │", output)
    return {m[1].strip(): float(m[2]) for m in rows}


@pytest.mark.slow
def test_install_end_to_end_without_systemd(tmp_path):
    openai = pytest.importorskip("openai")
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "XDG_"))}
    # The converted demo model comes from the shared cache; everything else lands in the temporary HOME.
    env.update(HOME=str(home), APPLIANCE_CACHE_DIR=str(demo_model.cache_dir()), HF_HUB_OFFLINE="1", COLUMNS="160")
    port = free_port()
    # 2,048 held-out tokens instead of 32,768 keep the two perplexities to about 10 s each on 2 cores; the AWQ
    # one is still about 1.16 times the unquantized one there, well inside the bounds checked below.
    install = [sys.executable, "-m", "appliance", "install", "--yes", "--no-service", "--port", str(port),
               "--eval-tokens", "2048"]

    def appliance(*args, timeout=120):
        return subprocess.run([sys.executable, "-m", "appliance", *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    try:
        first = subprocess.run(install, env=env, capture_output=True, text=True, timeout=2400)
        out = first.stdout
        assert first.returncode == 0, out + first.stderr
        assert "Quantizing to 4-bit AWQ" in out
        assert "Started the server in the background" in out and "--no-service" in out
        assert "What is the capital of France?" in out
        assert "HTTP Request:" not in out + first.stderr  # no library logging under the spinners
        assert f"http://127.0.0.1:{port}/v1" in out and "curl " in out and "OpenAI(base_url=" in out
        ppl = ppl_rows(out)
        assert set(ppl) == {"unquantized", "AWQ 4-bit g64"}, out  # SmolLM2's 576-wide layers take group size 64
        assert 1 < ppl["unquantized"] < ppl["AWQ 4-bit g64"] < 2 * ppl["unquantized"]

        conf_file = home / ".config" / "appliance" / "config.toml"
        conf = cfgmod.load(conf_file, env=False)
        assert (conf.port, conf.device, conf.quantization, conf.served_model_name) == \
            (port, "cpu", "awq", "SmolLM2-135M-Instruct")
        assert conf.dtype == ("bfloat16" if hardware.host()["cpu_bf16"] else "float32")  # the tuner's choice
        # the engine's default step: no key written, so a later engine default applies
        assert conf.max_num_batched_tokens is None and "max_num_batched_tokens" not in conf_file.read_text()
        assert conf.model.startswith(str(home / ".local" / "share" / "appliance" / "models"))
        assert '"quant_method": "awq"' in open(os.path.join(conf.model, "config.json")).read().replace("'", '"')
        assert (home / ".local" / "share" / "appliance" / "run" / "appliance.pid").is_file()

        status = appliance("status")
        assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chat = client.chat.completions.create(model=conf.served_model_name, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert chat.choices[0].message.content.strip()
        assert chat.choices[0].message.content.strip() in out  # the installer printed the same greedy answer

        second = subprocess.run(install, env=env, capture_output=True, text=True, timeout=1200)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "Reusing the quantized checkpoint" in second.stdout
        assert "Quantizing to" not in second.stdout and "Perplexity of the" not in second.stdout
        assert ppl_rows(second.stdout) == ppl
        assert "Stopping the running server" in second.stdout

        stop = appliance("stop")
        assert stop.returncode == 0 and "stopped" in stop.stdout
        assert appliance("status").returncode == 3
    finally:
        appliance("stop")

"""Shared by the tests/test_appliance_*.py files: a clean environment with HOME and the appliance paths in tmp."""
import os


def isolate(monkeypatch, tmp_path, *, paths: bool = True) -> None:
    """Drop APPLIANCE_* variables (keeping the shared model cache) and CUDA_DEVICE_ORDER, point HOME into
    ``tmp_path`` and, with ``paths``, the config file and data folder too."""
    for name in list(os.environ):
        if name.startswith("APPLIANCE_") and name != "APPLIANCE_CACHE_DIR":
            monkeypatch.delenv(name)
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "")  # recorded, so what `appliance serve` sets is undone after
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if paths:
        monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "config.toml"))

"""appliance.config: TOML round trip, APPLIANCE_<KEY> overrides, paths, atomic writes."""
import pytest
from appliance_testenv import isolate

from appliance import config as cfgmod
from appliance.config import Config, ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path, paths=False)


def test_round_trip_keeps_every_value(tmp_path):
    conf = Config(model="/models/x-awq", served_model_name="x", source_model="/src/x", quantization="awq",
                  host="0.0.0.0", port=8123, api_key="secret", device="cpu", gpu_memory_utilization=0.75,
                  cpu_kv_cache_gib=2.5, max_num_seqs=8, max_model_len=4096, kv_cache_dtype="fp8", swap_space=4.0,
                  dtype="bfloat16", tune_kernels=False, data_dir="/d")
    path = cfgmod.save(conf, tmp_path / "sub" / "config.toml")
    assert path == tmp_path / "sub" / "config.toml"
    assert cfgmod.load(path) == conf
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it holds an API key


def test_none_values_are_left_out_and_come_back_as_defaults(tmp_path):
    path = cfgmod.save(Config(model="/m"), tmp_path / "config.toml")
    text = path.read_text()
    assert "api_key" not in text and "max_model_len" not in text
    assert 'model = "/m"' in text
    loaded = cfgmod.load(path)
    assert loaded.api_key is None and loaded.max_model_len is None and loaded.port == 8000


def test_save_replaces_atomically_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "config.toml"
    cfgmod.save(Config(port=1111), path)
    cfgmod.save(Config(port=2222), path)
    assert cfgmod.load(path).port == 2222
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_env_overrides_every_kind_of_key(tmp_path, monkeypatch):
    path = cfgmod.save(Config(model="/m", port=8000, max_model_len=2048, gpu_memory_utilization=0.9),
                       tmp_path / "c.toml")
    monkeypatch.setenv("APPLIANCE_PORT", "9001")
    monkeypatch.setenv("APPLIANCE_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("APPLIANCE_MODEL", "/other")
    monkeypatch.setenv("APPLIANCE_MAX_MODEL_LEN", "none")
    monkeypatch.setenv("APPLIANCE_API_KEY", "k")
    conf = cfgmod.load(path)
    assert (conf.port, conf.gpu_memory_utilization, conf.model, conf.max_model_len, conf.api_key) == \
        (9001, 0.5, "/other", None, "k")
    assert cfgmod.load(path, env=False).port == 8000


def test_swap_space_reaches_the_engine_config(tmp_path, monkeypatch):
    path = cfgmod.save(Config(model="/m"), tmp_path / "c.toml")
    assert cfgmod.load(path).engine_config().swap_space == 0.0
    monkeypatch.setenv("APPLIANCE_SWAP_SPACE", "2.5")
    assert cfgmod.load(path).engine_config().swap_space == 2.5
    monkeypatch.setenv("APPLIANCE_SWAP_SPACE", "-1")
    with pytest.raises(ConfigError, match="swap_space: must be at least 0 GiB, got -1.0") as err:
        cfgmod.load(path).engine_config()
    assert err.value.hint == ("change swap_space in the config file, APPLIANCE_SWAP_SPACE or "
                              "`appliance serve --swap-space`")


def test_an_invalid_setting_names_where_to_fix_that_key(tmp_path):
    """The hint names the key the engine refused, its variable and its flag (it said "the APPLIANCE_* variable or
    the command's flag" for any key); a key with no flag gets none."""
    path = cfgmod.save(Config(model="/m", max_num_seqs=8, max_num_batched_tokens=4), tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 4 is smaller than max_num_seqs=8") as err:
        cfgmod.load(path).engine_config()
    assert err.value.hint == ("change max_num_batched_tokens in the config file, APPLIANCE_MAX_NUM_BATCHED_TOKENS "
                              "or `appliance serve --max-num-batched-tokens`")
    path = cfgmod.save(Config(model="/m", cpu_kv_cache_gib=-1.0), tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="cpu_kv_cache_gib") as err:
        cfgmod.load(path).engine_config()
    assert err.value.hint == "change cpu_kv_cache_gib in the config file, APPLIANCE_CPU_KV_CACHE_GIB"


def test_bad_env_value_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_PORT", "eighty")
    with pytest.raises(ConfigError, match="APPLIANCE_PORT"):
        cfgmod.load(tmp_path / "missing.toml")


def test_unknown_key_and_bad_toml_are_errors(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('prot = 8000\n')
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        cfgmod.load(bad)
    bad.write_text('port = "x"\n')
    with pytest.raises(ConfigError, match="port"):
        cfgmod.load(bad)
    bad.write_text('port = \n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        cfgmod.load(bad)


def test_paths_follow_xdg_and_overrides(tmp_path, monkeypatch):
    home = tmp_path / "home"
    assert cfgmod.config_path(system=False) == home / ".config" / "appliance" / "config.toml"
    assert cfgmod.data_dir() == home / ".local" / "share" / "appliance"
    assert cfgmod.config_path(system=True) == cfgmod.SYSTEM_CONFIG
    assert cfgmod.data_dir(system=True) == cfgmod.SYSTEM_DATA_DIR
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xd"))
    assert cfgmod.config_path() == tmp_path / "xc" / "appliance" / "config.toml"
    assert cfgmod.data_dir() == tmp_path / "xd" / "appliance"
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "explicit.toml"))
    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "data"))
    assert cfgmod.config_path(system=True) == tmp_path / "explicit.toml"
    assert cfgmod.data_dir(system=True) == tmp_path / "data"


def test_engine_config_carries_the_settings():
    pytest.importorskip("torch")
    ec = Config(model="/m", served_model_name="m", device="cpu", max_num_seqs=4, max_model_len=512,
                cpu_kv_cache_gib=0.5).engine_config()
    assert (ec.model, ec.served_model_name, ec.device, ec.max_num_seqs, ec.max_model_len, ec.cpu_kv_cache_gib) == \
        ("/m", "m", "cpu", 4, 512, 0.5)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        Config(model="/m", max_num_seqs=0).engine_config()


def test_the_compute_dtype_reaches_the_engine_and_a_bad_one_is_named(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    path = cfgmod.save(Config(model="/m", dtype="bfloat16"), tmp_path / "c.toml")
    assert cfgmod.load(path).engine_config().dtype == "bfloat16"
    old = tmp_path / "old.toml"
    old.write_text('model = "/m"\nport = 8001\n')  # a config written before the key existed
    assert cfgmod.load(old).dtype == "auto" and cfgmod.load(old).engine_config().dtype == "auto"
    monkeypatch.setenv("APPLIANCE_DTYPE", "bf16")
    with pytest.raises(ConfigError, match="dtype: must be auto, float32, bfloat16 or float16, got 'bf16'"):
        cfgmod.load(path).engine_config()


def test_tune_kernels_reaches_the_engine_with_its_plan_folder(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    path = cfgmod.save(Config(model="/m", data_dir="/var/lib/x"), tmp_path / "c.toml")
    ec = cfgmod.load(path).engine_config()
    assert ec.tune_kernels is True and ec.kernel_plans_dir == "/var/lib/x/kernel-plans"
    assert Config(model="/m").engine_config().kernel_plans_dir is None  # the engine's default folder
    for text, want in (("0", False), ("off", False), ("True", True), ("yes", True)):
        monkeypatch.setenv("APPLIANCE_TUNE_KERNELS", text)
        assert cfgmod.load(path).engine_config().tune_kernels is want
    monkeypatch.setenv("APPLIANCE_TUNE_KERNELS", "maybe")
    with pytest.raises(ConfigError, match="APPLIANCE_TUNE_KERNELS: expected true or false, got 'maybe'"):
        cfgmod.load(path)
    monkeypatch.delenv("APPLIANCE_TUNE_KERNELS")
    (tmp_path / "bad.toml").write_text('model = "/m"\ntune_kernels = 1\n')
    with pytest.raises(ConfigError, match="expected bool, got 1"):
        cfgmod.load(tmp_path / "bad.toml")

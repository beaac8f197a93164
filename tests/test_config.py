import re

import pytest

from vllm_kvdisk.core.config import (
    ENV_NAMES,
    FIELDS,
    ConfigError,
    KVDiskConfig,
    default_of,
    env_of,
    flag_of,
    load_config,
)


def test_defaults_follow_ds4():
    cfg = load_config({"kv_disk_dir": "/tmp/x"})
    assert cfg == KVDiskConfig(kv_disk_dir="/tmp/x")
    assert (
        cfg.kv_disk_space_mb,
        cfg.kv_cache_min_tokens,
        cfg.kv_cache_cold_max_tokens,
        cfg.kv_cache_continued_interval_tokens,
        cfg.kv_cache_boundary_trim_tokens,
        cfg.kv_cache_boundary_align_tokens,
        cfg.tool_memory_max_ids,
    ) == (8192, 512, 30000, 10000, 32, 2048, 100000)
    assert cfg.kv_cache_tail_checkpoints is True
    with pytest.raises(AttributeError):
        cfg.kv_disk_space_mb = 1  # frozen


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="kv_disk_spcae_mb"):
        load_config({"kv_disk_dir": "/tmp/x", "kv_disk_spcae_mb": 10})


@pytest.mark.parametrize(
    "key,value,msg",
    [
        ("kv_disk_space_mb", 8.5, "integer"),
        ("kv_disk_space_mb", "lots", "integer"),
        ("kv_disk_space_mb", 0, ">= 1"),
        ("kv_cache_boundary_trim_tokens", -1, ">= 0"),
        ("kv_cache_reject_different_quant", "maybe", "true or false"),
        ("kv_disk_load_policy", "sometimes", "always, auto"),
        ("kv_cache_boundary_trim_tokens", 4096, "smaller than"),
    ],
)
def test_bad_values_are_rejected_with_the_key(key, value, msg):
    with pytest.raises(ConfigError, match=msg) as err:
        load_config({"kv_disk_dir": "/tmp/x", key: value})
    assert key.split("_")[0] in str(err.value)


def test_missing_dir_and_string_coercion():
    with pytest.raises(ConfigError, match="kv_disk_dir is required"):
        load_config({})
    cfg = load_config(
        {"kv_disk_dir": "~/c", "kv_disk_space_mb": "64", "kv_cache_reject_different_quant": "true"}
    )
    assert cfg.kv_disk_space_mb == 64 and cfg.kv_cache_reject_different_quant is True
    assert cfg.kv_disk_dir.startswith("/") and cfg.space_bytes == 64 << 20


def test_environment_fills_what_the_config_lacks_and_typos_are_errors():
    env = {
        "KVDISK_DIR": "/data/kv",
        "KVDISK_SPACE_MB": "100",
        "KVDISK_CACHE_MIN_TOKENS": "64",
        "KVDISK_CACHE_TAIL_CHECKPOINTS": "false",
        "HOME": "/root",
    }
    cfg = load_config({}, env)
    assert (cfg.kv_disk_dir, cfg.kv_disk_space_mb, cfg.kv_cache_min_tokens) == ("/data/kv", 100, 64)
    assert cfg.kv_cache_tail_checkpoints is False
    assert load_config({"kv_disk_space_mb": 7}, env).kv_disk_space_mb == 7  # explicit wins
    with pytest.raises(ConfigError, match="KVDISK_SPACE_GB"):
        load_config({}, {**env, "KVDISK_SPACE_GB": "1"})
    with pytest.raises(ConfigError, match="kv_disk_space_mb: expected an integer"):
        load_config({}, {**env, "KVDISK_SPACE_MB": "1.5"})


def test_every_knob_has_help_a_flag_and_an_environment_name():
    assert len(ENV_NAMES) == len(FIELDS)  # no two knobs share a variable
    for name, f in FIELDS.items():
        assert f.metadata["help"] and flag_of(name).startswith("--")
        assert re.fullmatch(r"KVDISK_[A-Z0-9_]+", env_of(name))
    assert flag_of("kv_disk_dir") == "--kv-disk-dir" and env_of("kv_disk_dir") == "KVDISK_DIR"
    assert flag_of("trace") == "--trace" and default_of("kv_disk_space_mb") == 8192


def test_the_readme_table_is_the_one_derived_from_the_config():
    import os

    from vllm_kvdisk.core.config import markdown_table

    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    assert markdown_table() in readme
    for name in FIELDS:
        assert f"`{flag_of(name)}" in markdown_table() and f"`{env_of(name)}`" in markdown_table()


def test_object_url_is_checked_at_load():
    cfg = load_config({"kv_disk_dir": "/tmp/x", "kv_object_url": "s3://my-bucket/fleet"})
    assert cfg.kv_object_url == "s3://my-bucket/fleet" and cfg.kv_object_deadline_s == 10
    env = load_config({"kv_disk_dir": "/tmp/x"}, {"KVDISK_OBJECT_URL": "s3://my-bucket"})
    assert env.kv_object_url == "s3://my-bucket"
    with pytest.raises(ConfigError, match="kv_object_url"):
        load_config({"kv_disk_dir": "/tmp/x", "kv_object_url": "https://my-bucket/x"})

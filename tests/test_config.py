import pytest

from vllm_kvdisk.config import ConfigError, KVDiskConfig, load_config


def test_defaults_follow_ds4():
    cfg = load_config({"kv_disk_dir": "/tmp/x"})
    assert cfg == KVDiskConfig(kv_disk_dir="/tmp/x")
    assert (cfg.kv_disk_space_mb, cfg.kv_cache_min_tokens, cfg.kv_cache_cold_max_tokens,
            cfg.kv_cache_continued_interval_tokens, cfg.kv_cache_boundary_trim_tokens,
            cfg.kv_cache_boundary_align_tokens, cfg.tool_memory_max_ids) == (
        8192, 512, 30000, 10000, 32, 2048, 100000)
    with pytest.raises(AttributeError):
        cfg.kv_disk_space_mb = 1  # frozen


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="kv_disk_spcae_mb"):
        load_config({"kv_disk_dir": "/tmp/x", "kv_disk_spcae_mb": 10})


@pytest.mark.parametrize("key,value,msg", [
    ("kv_disk_space_mb", 8.5, "integer"),
    ("kv_disk_space_mb", "lots", "integer"),
    ("kv_disk_space_mb", 0, ">= 1"),
    ("kv_cache_boundary_trim_tokens", -1, ">= 0"),
    ("kv_cache_reject_different_quant", "maybe", "true or false"),
    ("kv_disk_load_policy", "sometimes", "always, auto"),
    ("kv_cache_boundary_trim_tokens", 4096, "smaller than"),
])
def test_bad_values_are_rejected_with_the_key(key, value, msg):
    with pytest.raises(ConfigError, match=msg) as err:
        load_config({"kv_disk_dir": "/tmp/x", key: value})
    assert key.split("_")[0] in str(err.value)


def test_missing_dir_and_string_coercion():
    with pytest.raises(ConfigError, match="kv_disk_dir is required"):
        load_config({})
    cfg = load_config({"kv_disk_dir": "~/c", "kv_disk_space_mb": "64",
                       "kv_cache_reject_different_quant": "true"})
    assert cfg.kv_disk_space_mb == 64 and cfg.kv_cache_reject_different_quant is True
    assert cfg.kv_disk_dir.startswith("/") and cfg.space_bytes == 64 << 20

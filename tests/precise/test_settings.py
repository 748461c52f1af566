"""Precise-mode settings: the config's `precise` section from flags/environment/YAML, and a clear exit
(naming the `precise` extra) when precise mode is asked for without its packages.

No `tokenizers` needed here: the missing-extra cases are what this file is for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.support.routerproc import free_port
from router.config_loader import load_config
from router.precise import PreciseSettings, build_precise

ROOT = Path(__file__).resolve().parents[2]
EXTRA_HINT = "pip install 'kvroute[precise]'"


WORKER = ["--worker", "w1=http://h:1"]


def test_flags_become_one_settings_object() -> None:
    config = load_config(
        [*WORKER, "--tokenizer", "/models/m", "--block-size", "16", "--hash-seed=7", "--kv-events", "w1=tcp://h:1",
         "--kv-events", "w2=tcp://g:2", "--no-kv-events-discover", "--kv-events-cpu", "worker"],
        {},
    )
    assert config.precise == PreciseSettings(
        tokenizer="/models/m", block_size=16, hash_seed="7", kv_events=["w1=tcp://h:1", "w2=tcp://g:2"],
        kv_events_discover=False, kv_events_cpu="worker",
    )


def test_unset_variables_are_the_settings_defaults() -> None:
    assert load_config(WORKER, {}).precise == PreciseSettings()
    assert load_config(WORKER, {"KVROUTE_TOKENIZER": "/models/m"}).precise == PreciseSettings(tokenizer="/models/m")
    assert build_precise(PreciseSettings()) is None


def test_precise_settings_from_the_environment_and_yaml(tmp_path: Path) -> None:
    env = {"KVROUTE_TOKENIZER": "/models/m", "KVROUTE_KV_EVENTS": "w1=tcp://h:1,replay=tcp://h:2;w2=tcp://g:2",
           "KVROUTE_KV_EVENTS_DISCOVER": "0", "KVROUTE_BLOCK_SIZE": "32"}
    expected = PreciseSettings(tokenizer="/models/m", block_size=32, kv_events=["w1=tcp://h:1,replay=tcp://h:2", "w2=tcp://g:2"],
                               kv_events_discover=False)
    assert load_config(WORKER, env).precise == expected
    flat = tmp_path / "flat.yaml"
    flat.write_text("tokenizer: /models/m\nblock_size: 32\nkv_events_discover: false\n"
                    "kv_events: ['w1=tcp://h:1,replay=tcp://h:2', 'w2=tcp://g:2']\n")
    assert load_config([*WORKER, "--config", str(flat)], {}).precise == expected
    nested = tmp_path / "nested.yaml"
    nested.write_text("precise:\n  tokenizer: /models/m\n  block_size: 32\n  kv_events_discover: false\n"
                      "  kv_events: ['w1=tcp://h:1,replay=tcp://h:2', 'w2=tcp://g:2']\n")
    assert load_config([*WORKER, "--config", str(nested)], {}).precise == expected
    # without a tokenizer precise mode is off and its other settings are not read
    assert load_config(WORKER, {"KVROUTE_BLOCK_SIZE": "x"}).precise == PreciseSettings()


def test_build_precise_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    with pytest.raises(SystemExit, match=r"tokenizers.*pip install 'kvroute\[precise\]'"):
        build_precise(PreciseSettings(tokenizer=str(tmp_path)))


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_with_a_tokenizer_but_without_the_extra_exits_before_starting(tmp_path: Path, processes: str) -> None:
    blocked = "import sys; sys.modules['tokenizers'] = None; from router.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "serve", "--worker", "w1=http://127.0.0.1:9", "--port", str(free_port()),
         "--processes", processes, "--tokenizer", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    assert EXTRA_HINT in proc.stderr and "tokenizers" in proc.stderr, proc.stderr
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "Uvicorn" not in output and "Started" not in output, output

"""Precise mode's command-line flags and `KVROUTE_*` variables, to `PreciseSettings`.

`kvroute serve` moves the flags from argv into the environment (`take_precise_flags`) and
every router process reads them back from there (`settings_from_env`). Thin adapters over
`router/precise/settings.py`, kept apart so that they go in one piece when these settings
become ordinary router config keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, cast

from router.precise.settings import PreciseSettings, build_precise

if TYPE_CHECKING:
    from cache_client.kv_events import CpuMedium
    from router.precise.events import PreciseMode

PRECISE_FLAGS = {
    "--tokenizer": "TOKENIZER",
    "--block-size": "BLOCK_SIZE",
    "--hash-algo": "HASH_ALGO",
    "--hash-seed": "HASH_SEED",
    "--kv-events": "KV_EVENTS",
    "--kv-events-discover": "KV_EVENTS_DISCOVER",
    "--kv-events-cpu": "KV_EVENTS_CPU",
}
PRECISE_HELP = """precise mode (router/precise/; each also as env KVROUTE_<NAME>):
  --tokenizer PATH        model dir (tokenizer.json + tokenizer_config.json): precise mode on
  --block-size N          vLLM block size (default: the workers' vllm:cache_config_info)
  --hash-algo ALGO        sha256 | sha256_cbor (default: the workers' cache_config_info)
  --hash-seed SEED        the workers' PYTHONHASHSEED, if they set one
  --kv-events NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]   (repeatable)
  --kv-events-discover / --no-kv-events-discover
                          ask workers without --kv-events for /kv_event_sources (default on)
  --kv-events-cpu pool|worker|ignore
                          where CPU-medium events go (default pool: LMCache's shared pool)"""
ENV_PREFIX = "KVROUTE_"


def take_precise_flags(argv: list[str], environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Move precise-mode flags from `argv` into `KVROUTE_*` variables; return the rest.

    Precise mode is configured through the environment so that every router process of
    `--processes N` (uvicorn re-imports the app from the environment) gets the same.
    """
    env = os.environ if environ is None else environ
    rest: list[str] = []
    events: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(PRECISE_HELP)
            rest.append(arg)
        elif name == "--no-kv-events-discover" and not eq:
            env[ENV_PREFIX + "KV_EVENTS_DISCOVER"] = "0"
        elif name in PRECISE_FLAGS:
            if not eq:
                if name == "--kv-events-discover":
                    env[ENV_PREFIX + "KV_EVENTS_DISCOVER"] = "1"
                    i += 1
                    continue
                if i + 1 >= len(argv):
                    raise SystemExit(f"kvroute: {name} needs a value")
                i += 1
                value = argv[i]
            if name == "--kv-events":
                events.append(value)
            else:
                env[ENV_PREFIX + PRECISE_FLAGS[name]] = value
        else:
            rest.append(arg)
        i += 1
    if events:
        env[ENV_PREFIX + "KV_EVENTS"] = ";".join(events)
    return rest


def settings_from_env(environ: Mapping[str, str] | None = None) -> PreciseSettings:
    """The settings `KVROUTE_TOKENIZER` & co. give (unchecked: `build_precise` checks them)."""
    env = os.environ if environ is None else environ
    kv_events = [a for a in env.get(ENV_PREFIX + "KV_EVENTS", "").split(";") if a]
    tokenizer = env.get(ENV_PREFIX + "TOKENIZER")
    if not tokenizer:  # precise mode off: its other variables are not read, as they never were
        return PreciseSettings(kv_events=kv_events)
    block = env.get(ENV_PREFIX + "BLOCK_SIZE")
    return PreciseSettings(
        tokenizer=tokenizer,
        block_size=int(block) if block else None,
        hash_algo=env.get(ENV_PREFIX + "HASH_ALGO"),
        hash_seed=env.get(ENV_PREFIX + "HASH_SEED"),
        kv_events=kv_events,
        kv_events_discover=env.get(ENV_PREFIX + "KV_EVENTS_DISCOVER", "1").lower() not in ("0", "false", "no", "off"),
        kv_events_cpu=cast("CpuMedium", env.get(ENV_PREFIX + "KV_EVENTS_CPU", "pool")),
    )


def precise_from_env(environ: Mapping[str, str] | None = None) -> PreciseMode | None:
    """The precise chain builder configured by `KVROUTE_TOKENIZER` & co., or None."""
    return build_precise(settings_from_env(environ))

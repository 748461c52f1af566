"""`kvroute serve`: flags, `KVROUTE_*` environment variables and a YAML file → RouterConfig.

Every field of `RouterConfig` is a flag (`kv_capacity_tokens` ↔ `--kv-capacity-tokens`), an
environment variable (`KVROUTE_KV_CAPACITY_TOKENS`) and a YAML key (`kv_capacity_tokens`).
Precedence: flag > environment > YAML file > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import sys
import types
import typing
from typing import Any

import orjson

from cache_client.base import IndexObserver
from router.config import RouterConfig
from router.policies import POLICIES
from router.workers import WorkerSpec, parse_worker_arg

ENV_PREFIX = "KVROUTE_"
LIST_FLAGS = {"workers": "--worker", "discover": "--discover", "api_keys": "--api-keys"}
HELP = {
    "workers": "a worker as NAME=URL or URL (repeatable)",
    "discover": "discover workers, e.g. dns://HEADLESS_SERVICE:PORT (repeatable)",
    "policy": "routing policy",
    "redis": "share the index through Redis: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... (TLS), "
    "redis+cluster://HOST:PORT[,HOST:PORT...] or ?cluster=true (Redis Cluster); see docs/redis.md",
    "redis_prefix": "key prefix (and Redis Cluster hash tag) of this deployment's index in Redis",
    "redis_ttl_s": "Redis index entries unused for this many seconds expire",
    "redis_lookup_budget_ms": "longest a lookup waits for Redis before routing on the local view",
    "pool_capacity_tokens": "the workers share an LMCache CPU pool of this many tokens (0: no pool)",
    "kv_capacity_tokens": "KV capacity of each worker in tokens, for the LRU capacity model",
    "processes": "router processes on one port (share state through --redis)",
    "api_keys": "client API keys accepted on /v1/* (comma-separated, repeatable; env KVROUTE_API_KEYS); "
    "prefer --api-keys-file, a flag shows in ps",
    "api_keys_file": "file of client API keys, one a line (# comments)",
    "admin_token": "token for /admin/* and /debug/route; prefer env KVROUTE_ADMIN_TOKEN or --admin-token-file",
    "admin_token_file": "file holding the admin token",
    "upstream_client": "forwarding client: raw (default), or httpx / aiohttp to compare in benchmarks",
    "max_inflight_per_worker": "requests in flight to one worker before new ones queue (0: no limit)",
    "queue_size": "requests that may wait for a worker slot; beyond, 429 with Retry-After",
    "queue_timeout_s": "longest a request waits for a worker slot before 429",
    "shutdown_grace_s": "on SIGTERM, how long in-flight requests and streams may take to finish",
    "keep_alive_s": "idle client connections are kept this long (longer than clients keep theirs)",
    "breaker_failures": "consecutive failures that open a worker's circuit (0: never)",
    "outlier_interval_s": "how often error-rate/latency outliers are judged and ejected (0: off)",
}


def _base_type(annotation: Any) -> type:
    hint = typing.get_type_hints(RouterConfig)[annotation] if isinstance(annotation, str) else annotation
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute serve",
        description="KV-cache-aware OpenAI-compatible router for vLLM workers.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML config file (env KVROUTE_CONFIG)")
    hints = typing.get_type_hints(RouterConfig)
    for f in dataclasses.fields(RouterConfig):
        help_ = HELP.get(f.name, "")
        if f.name in LIST_FLAGS:
            parser.add_argument(LIST_FLAGS[f.name], dest=f.name, action="append", help=help_)
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        elif f.name == "policy":
            parser.add_argument(flag, dest=f.name, choices=sorted(POLICIES), help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, help=help_)
    return parser


def _coerce(name: str, value: Any) -> Any:
    hints = typing.get_type_hints(RouterConfig)
    kind = _base_type(hints[name])
    if name == "workers":
        items = value.split(",") if isinstance(value, str) else list(value)
        return [_worker(v) for v in items if v]
    if name == "discover":
        return [v for v in (value.split(",") if isinstance(value, str) else list(value)) if v]
    if name == "api_keys":
        items = [value] if isinstance(value, str) else list(value)
        return [k.strip() for item in items for k in str(item).split(",") if k.strip()]
    if value is None:
        return None
    if kind is bool and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def _worker(value: Any) -> WorkerSpec:
    if isinstance(value, WorkerSpec):
        return value
    if isinstance(value, dict):
        spec = parse_worker_arg(f"{value['name']}={value['url']}" if "name" in value else value["url"])
        api_key = value.get("api_key")
        if value.get("api_key_env"):
            api_key = os.environ.get(value["api_key_env"])
        return dataclasses.replace(spec, api_key=api_key)
    return parse_worker_arg(str(value))


def load_config(argv: list[str], environ: dict[str, str] | None = None) -> RouterConfig:
    env = dict(os.environ if environ is None else environ)
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    config_path = args.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        import yaml

        with open(config_path, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"kvroute: {config_path}: expected a mapping of settings")
        for key, value in loaded.items():
            values[key.replace("-", "_")] = value
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    unknown = set(values) - names
    if unknown:
        raise SystemExit(f"kvroute: unknown settings in {config_path}: {', '.join(sorted(unknown))}")
    for name in names:
        for env_name in (ENV_PREFIX + name.upper(), ENV_PREFIX + LIST_FLAGS.get(name, "").lstrip("-").upper()):
            if env_name != ENV_PREFIX and env_name in env:
                values[name] = env[env_name]
    values.update(args)
    try:
        coerced = {k: _coerce(k, v) for k, v in values.items()}
    except (ValueError, TypeError, KeyError) as exc:
        raise SystemExit(f"kvroute: bad setting: {exc}") from None
    config = RouterConfig(**coerced)
    if config.policy not in POLICIES:
        raise SystemExit(f"kvroute: unknown policy {config.policy!r}")
    return config


def check_secrets(config: RouterConfig) -> None:
    """Read the secrets files now, at startup (not in load_config: a rendered config names
    files that exist only where it is deployed); fail with a message that names the
    setting, never the secret."""
    from router.auth import resolve_admin_token, resolve_api_keys

    try:
        resolve_api_keys(config.api_keys, config.api_keys_file)
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --api-keys-file: {exc.strerror}") from None
    if config.api_keys_file and not resolve_api_keys([], config.api_keys_file):
        raise SystemExit("kvroute: --api-keys-file holds no key")
    try:
        resolve_admin_token(config.admin_token, config.admin_token_file)
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --admin-token-file: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"kvroute: --admin-token-file: {exc}") from None


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # httpx logs every request with its URL at INFO; worker addresses stay out of logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def redis_components(config: RouterConfig, observer: IndexObserver | None = None) -> dict[str, Any]:
    """The `--redis` components for `build_app`: `index` (RedisIndex, reporting its health
    to `observer`) and `loads` (RedisLoadBoard), sharing one client. Connects lazily, on
    the first call in the app's loop."""
    from cache_client.redis_index import RedisIndex, RedisIndexSettings
    from router.load.redis import RedisLoadBoard

    if not config.redis:
        raise ValueError("no --redis URL configured")
    settings = RedisIndexSettings(
        url=config.redis,
        prefix=config.redis_prefix,
        ttl_s=config.redis_ttl_s,
        lookup_budget_ms=config.redis_lookup_budget_ms,
        default_capacity_tokens=config.kv_capacity_tokens,
    )
    index = RedisIndex.from_settings(settings, observer)
    loads = RedisLoadBoard(
        index.backend, prefix=config.redis_prefix, half_life_s=config.recent_half_life_s,
        replica_id=f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(3)}",
    )
    logging.getLogger("kvroute.redis").info(
        "index and loads shared through %s, prefix %s", index.backend.settings.display(), index.tag
    )
    return {"index": index, "loads": loads}


def make_app(config: RouterConfig):
    from router.app import build_app
    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    components: dict[str, Any] = {"metrics": metrics}
    if config.redis:
        components.update(redis_components(config, observer=metrics))
    from router.precise.flags import precise_from_env  # precise mode: --tokenizer & co.

    chains = precise_from_env()
    if chains is not None:
        components["chains"] = chains
    return build_app(config, **components)


_CONFIG_ENV = "KVROUTE__SERVE_CONFIG_JSON"


def app_from_env():
    """uvicorn factory for `--processes N`: each process rebuilds the app from the config."""
    raw = orjson.loads(os.environ[_CONFIG_ENV])
    raw["workers"] = [WorkerSpec(**w) for w in raw["workers"]]
    config = RouterConfig(**raw)
    configure_logging(config.log_level)
    return make_app(config)


def _exit_zero(signum: int, frame: types.FrameType | None) -> None:
    sys.exit(0)


def exit_zero_on_sigterm() -> None:
    """SIGTERM ends `kvroute serve` with status 0 once in-flight work is drained.

    While it serves, uvicorn holds SIGTERM (stop accepting, let requests and streams finish for
    timeout_graceful_shutdown) and afterwards re-raises it. Under the default action the drained
    process then died of the signal (status 143) wherever it is not PID 1 (a shell, systemd,
    `buildah run`), while as a container's PID 1 the kernel drops the re-raised signal and it
    exited 0. This handler makes both exit 0, and makes a SIGTERM that arrives while the app is
    being built (Redis connect included) end the process at once, which PID 1 without a handler
    would ignore until the SIGKILL. Installed just before serving, once the config is valid, so
    a `cli` call that refuses its config (tests make such calls in-process) leaves signals alone.
    """
    signal.signal(signal.SIGTERM, _exit_zero)


def cli(argv: list[str]) -> int:
    import uvicorn

    from router.precise import require_precise_extra
    from router.precise.flags import settings_from_env, take_precise_flags

    argv = take_precise_flags(argv)  # precise-mode flags travel as KVROUTE_* env
    config = load_config(argv)
    check_secrets(config)
    if settings_from_env().tokenizer:
        require_precise_extra()  # a clear exit now, not a traceback in every router process
    configure_logging(config.log_level)
    if not config.workers and not config.discover:
        print("kvroute serve: give at least one --worker NAME=URL or --discover TARGET", file=sys.stderr)
        return 2
    exit_zero_on_sigterm()
    common: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=config.log_level,
        access_log=False,
        server_header=False,
        backlog=4096,
        # SIGTERM: stop accepting, let in-flight requests and streams finish this long.
        timeout_graceful_shutdown=config.shutdown_grace_s,
        timeout_keep_alive=config.keep_alive_s,
    )
    if config.processes > 1:
        os.environ[_CONFIG_ENV] = orjson.dumps(dataclasses.asdict(config)).decode()
        uvicorn.run("router.serve:app_from_env", factory=True, workers=config.processes, **common)
    else:
        uvicorn.run(make_app(config), **common)
    return 0

"""`kvroute serve`: the config (router/config_loader.py builds it from flags, `KVROUTE_*`
environment variables and a YAML file), checked, then served by uvicorn.
"""

from __future__ import annotations

import logging
import signal
import sys
import types
from collections.abc import Mapping
from typing import Any

from router.config import RouterConfig
from router.config_loader import config_for_child, environment, hand_to_children, load_config

__all__ = ["app_from_env", "check_secrets", "cli", "configure_logging", "load_config", "make_app"]


def check_secrets(config: RouterConfig) -> None:
    """Read the secrets files now, at startup (not in load_config: a rendered config names
    files that exist only where it is deployed); fail with a message that names the
    setting, never the secret."""
    from router.auth import resolve_admin_token, resolve_api_keys

    security = config.security
    try:
        resolve_api_keys(security.api_keys, security.api_keys_file)
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --api-keys-file: {exc.strerror}") from None
    if security.api_keys_file and not resolve_api_keys([], security.api_keys_file):
        raise SystemExit("kvroute: --api-keys-file holds no key")
    try:
        resolve_admin_token(security.admin_token, security.admin_token_file)
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --admin-token-file: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"kvroute: --admin-token-file: {exc}") from None
    check_tenants(config)
    try:
        config.isolation.configured_secret()
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --tenant-salt-secret-file: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"kvroute: tenant_salt_secret: {exc}") from None



def check_tenants(config: RouterConfig) -> None:
    """Load the tenants file now: a bad one stops the router with the line it is wrong on,
    never a router running with half a config."""
    from router.tenants.loader import load_tenants

    if config.tenants.file is None:
        return
    try:
        load_tenants(config.tenants.file)
    except OSError as exc:
        raise SystemExit(f"kvroute: cannot read --tenants file: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"kvroute: bad tenants file: {exc}") from None


def with_process_secret(config: RouterConfig) -> RouterConfig:
    """`--processes N` without Redis or a configured salt secret: the parent makes one, so
    that its children derive the same tenant cache salts (router/tenants/salt.py)."""
    import dataclasses

    from router.tenants.salt import random_secret

    if config.redis.url or config.isolation.configured_secret():
        return config
    return dataclasses.replace(config, isolation=dataclasses.replace(config.isolation, salt_secret=random_secret()))


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # httpx logs every request with its URL at INFO; worker addresses stay out of logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def make_app(config: RouterConfig, environ: Mapping[str, str] | None = None):
    from router.app import build_app

    return build_app(config, environ=environment() if environ is None else environ)


def app_from_env():
    """uvicorn factory for `--processes N`: each process rebuilds the app from the parent's config."""
    config = config_for_child()
    configure_logging(config.server.log_level)
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

    environ = environment()
    config = load_config(argv, environ)
    check_secrets(config)
    if config.precise.tokenizer:
        require_precise_extra()  # a clear exit now, not a traceback in every router process
    if config.tracing.enabled:
        from router.tracing import require_tracing_extra

        require_tracing_extra()
    server = config.server
    configure_logging(server.log_level)
    if not config.workers and not config.discover:
        print("kvroute serve: give at least one --worker NAME=URL or --discover TARGET", file=sys.stderr)
        return 2
    exit_zero_on_sigterm()
    common: dict[str, Any] = dict(
        host=server.host,
        port=server.port,
        loop="uvloop",
        http="httptools",
        log_level=server.log_level,
        access_log=False,
        server_header=False,
        backlog=4096,
        # SIGTERM: stop accepting, let in-flight requests and streams finish this long.
        timeout_graceful_shutdown=server.shutdown_grace_s,
        timeout_keep_alive=server.keep_alive_s,
    )
    if server.processes > 1:
        hand_to_children(with_process_secret(config))
        uvicorn.run("router.serve:app_from_env", factory=True, workers=server.processes, **common)
    else:
        uvicorn.run(make_app(config, environ), **common)
    return 0

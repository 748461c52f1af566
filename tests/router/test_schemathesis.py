"""schemathesis against the running router (in front of simulated workers), driven by the
hand-written router/openapi.json: no 5xx, and every answer (status, content type, headers,
body) conforms to the schema.

Examples per operation: KVROUTE_FUZZ_EXAMPLES (default 20). schemathesis adds its coverage
phase (boundary values, missing fields, unsupported methods) to the generated examples, so
the default run already sends over 1,000 requests; the count is printed at the end (-s).
The mutating admin operations (add, remove, drain, undrain) are cut from the schema given
to the fuzzer: adding workers at generated URLs would send health checks to arbitrary
hosts, and draining the fleet would turn the rest of the run into 503s.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from loadtests.sim.cluster import SimCluster
from router.app import OPENAPI_PATH
from tests.support.upstream import RecordingUpstream

EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "20"))
SIM_MODEL = "sim-llama3-8b"
EMB_MODEL = "emb-model"
API_KEY = "fuzz-client-key-0123456789"
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
MUTATING = ["addWorker", "removeWorker", "drainWorker", "undrainWorker"]
CALLS: Counter[str] = Counter()
STATUSES: Counter[int] = Counter()


pytestmark = [
    pytest.mark.sim_cluster(workers=2, time_scale=0.02, pool=False),
    pytest.mark.recording_upstream(model=EMB_MODEL),
    pytest.mark.router_process(
        extra_args=["--max-body-bytes", "1000000", "--log-level", "info"],
        log_path=os.environ.get("KVROUTE_FUZZ_ROUTER_LOG"),
        env={"KVROUTE_API_KEYS": API_KEY, "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN},
    ),
]


@pytest.fixture(scope="module")
def router_workers(cluster: SimCluster, upstream: RecordingUpstream) -> dict[str, str]:
    """The simulated workers serve chat and completions, the recording upstream embeddings."""
    return {**cluster.worker_urls, "emb": upstream.url}


def fuzz_schema() -> dict:
    """The served schema, with model names narrowed to the ones this fleet serves (a random
    string would be a 404 every time and never reach a worker) and output lengths bounded."""
    spec = copy.deepcopy(json.loads(OPENAPI_PATH.read_text()))
    for path, ops in list(spec["paths"].items()):
        for method, op in list(ops.items()):
            if op.get("operationId") in MUTATING:
                del ops[method]
        if not ops:
            del spec["paths"][path]
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest", "CountTokensRequest", "PassThroughRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [SIM_MODEL]}
        # The router does not read these; huge values would only test how long the
        # simulator takes to decode 100k tokens.
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in props or (name, field) == ("ResponsesRequest", "max_output_tokens"):
                props[field] = {"type": "integer", "minimum": 1, "maximum": 64}
    schemas["EmbeddingRequest"]["properties"]["model"] = {"type": "string", "enum": [EMB_MODEL]}
    return spec


@pytest.fixture(scope="module")
def api_schema(router):
    schema = schemathesis.openapi.from_dict(fuzz_schema())
    schema.config.update(base_url=router.url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    yield schema
    total = sum(CALLS.values())
    print(f"\nschemathesis: {total} requests, statuses {dict(sorted(STATUSES.items()))}, per operation {dict(CALLS)}")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_router_conforms_to_its_schema(case) -> None:
    assert case.operation.definition.raw.get("operationId") not in MUTATING
    admin = case.operation.path.startswith(("/admin", "/debug"))
    token = ADMIN_TOKEN if admin else API_KEY
    response = case.call(headers={"authorization": f"Bearer {token}"}, timeout=30)
    CALLS[case.operation.label] += 1
    STATUSES[response.status_code] += 1
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_headers_conformance,
            response_schema_conformance,
        ],
    )
    text = response.text
    assert "Traceback" not in text and API_KEY not in text and ADMIN_TOKEN not in text

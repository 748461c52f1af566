#!/usr/bin/env bash
# CI stage: precise mode against real vLLM + LMCache (called from .ci/run).
#
# Creates or reuses the vLLM venv and the tiny model (setup_env.sh), then runs the
# end-to-end checks (run_e2e.py), all of them counts of tokens, none a timing: exactness
# against /tokenize, agent APIs (Responses / Messages requests: the router's tokens equal
# vLLM's /v1/responses/render and /v1/messages/render, and a follow-up turn reuses exactly
# the predicted blocks; 7 cases, a few seconds), reuse (precise cache_aware has the engines reuse >= 90% of the
# reusable prompt tokens of a workload that overflows one worker), (a) predicted == actual
# cached tokens per request, (c) a moved conversation is a pool hit of exactly the
# predicted tokens, nodes (two LMCache servers as two nodes, a worker on each: the router
# predicts pool hits only on the worker whose node's server holds the prefix, exactly what
# that server loads; ~50 s, most of it w2's restart on the second server), vlm (a worker
# serving a tiny Qwen2-VL, the router in estimate mode with --image-rule qwen2_vl: over
# multi-turn image conversations, predicted prompt tokens within 10% of the engine's per
# request and predicted cached tokens within 10% of its cached tokens in all; 40-65 s, all
# but a few seconds of it the VLM worker's start), tracing (the workers run with
# --otlp-traces-endpoint at the harness's OTLP receiver; a request with a client traceparent
# through kvroute, and one retried after a failing worker: vLLM's llm_request span is a child
# of kvroute's attempt span under the client's trace id; ~4 s), pd (a prefill/decode split:
# two workers of its own on vLLM's example KV connector over one temporary directory, P a
# kv_producer and D a kv_consumer, kvroute with --role flags, --pd-connector shared-storage
# and --pd-split always; a multi-turn chat through it: every answer a 200 from D with route
# reason pd, P given every prompt, and D's external prefix-cache hits exactly what the
# connector loads of what P wrote; ~40 s, most of it the two workers' start). The TTFT
# comparison with random is a benchmark, not a check:
#   python -m loadtests.e2e.vllm.run_e2e --ttft-benchmark --venv V --model M --out ttft.json
# The tiny model runs in bfloat16 on CPUs with AVX-512 BF16 or AMX, in float32 elsewhere
# (run_e2e.native_dtype; KVROUTE_E2E_ARGS="--dtype float32" chooses).
# Writes the JSON report to $KVROUTE_E2E_REPORT (default: vllm-e2e-report.json in the
# current directory) and exits non-zero if any check fails. A few minutes with the venv
# cached; building the venv on a fresh machine adds its download and install.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
REPORT="${KVROUTE_E2E_REPORT:-$PWD/vllm-e2e-report.json}"
PY="${PYTHON:-python3}"
START=$(date +%s)

eval "$("$HERE/setup_env.sh" | grep -E '^(VENV|MODEL|VLM|VLM_SITE)=')"
echo "vllm_e2e: environment ready in $(( $(date +%s) - START ))s (venv $VENV, model $MODEL, vlm $VLM)"

cd "$ROOT"
# The router side of precise mode needs the `precise` extra (tokenizers + jinja2).
if ! "$PY" -c "import tokenizers, jinja2" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[precise]"
fi
status=0
# KVROUTE_E2E_ARGS: extra run_e2e.py arguments (e.g. --skip-reuse or --skip-nodes for a
# quicker run, --only-nodes, --only-vlm or --only-pd for phase `nodes`, `vlm` or `pd` alone).
# shellcheck disable=SC2086
"$PY" -m loadtests.e2e.vllm.run_e2e --venv "$VENV" --model "$MODEL" --vlm-model "$VLM" --vlm-site "$VLM_SITE" \
    --out "$REPORT" ${KVROUTE_E2E_ARGS:-} || status=$?
echo "vllm_e2e: finished in $(( $(date +%s) - START ))s, report $REPORT"
# The closing line CI reads: one check per acceptance point.
"$PY" - "$REPORT" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
names = ("exactness", "agent", "tracing", "reuse", "a", "c", "nodes", "vlm", "pd")
passed = sum(1 for k in names if isinstance(r.get(k), dict) and r[k].get("ok"))
print(f"{passed} passed, {len(names) - passed} failed; phases (s): {r.get('phase_s')}, startup {r.get('startup_s')} s, "
      f"dtype {r.get('dtype')}")
EOF
exit $status

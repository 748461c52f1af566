#!/usr/bin/env bash
# CI stage: precise mode against real vLLM + LMCache (called from .ci/run).
#
# Creates or reuses the vLLM venv and the tiny model (setup_env.sh), then runs the whole
# end-to-end check (run_e2e.py): exactness against /tokenize, (a) predicted == actual
# cached tokens per request, (b) precise cache_aware mean TTFT <= 1/3 of random, (c) a
# moved conversation is served from the LMCache pool. Writes the JSON report to
# $KVROUTE_E2E_REPORT (default: vllm-e2e-report.json in the current directory) and exits
# non-zero if any check fails. Budget: under 15 minutes on a fresh machine, venv included.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
REPORT="${KVROUTE_E2E_REPORT:-$PWD/vllm-e2e-report.json}"
PY="${PYTHON:-python3}"
START=$(date +%s)

eval "$("$HERE/setup_env.sh" | grep -E '^(VENV|MODEL)=')"
echo "vllm_e2e: environment ready in $(( $(date +%s) - START ))s (venv $VENV, model $MODEL)"

cd "$ROOT"
# The router side of precise mode needs the `precise` extra (tokenizers + jinja2).
if ! "$PY" -c "import tokenizers, jinja2" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[precise]"
fi
status=0
# KVROUTE_E2E_ARGS: extra run_e2e.py arguments (e.g. --skip-policies for a quick run).
# shellcheck disable=SC2086
"$PY" -m loadtests.vllm_e2e.run_e2e --venv "$VENV" --model "$MODEL" --out "$REPORT" ${KVROUTE_E2E_ARGS:-} || status=$?
echo "vllm_e2e: finished in $(( $(date +%s) - START ))s, report $REPORT"
# The closing line CI reads: one check per acceptance point.
"$PY" - "$REPORT" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
names = ("exactness", "a", "b", "c")
passed = sum(1 for k in names if isinstance(r.get(k), dict) and r[k].get("ok"))
print(f"{passed} passed, {len(names) - passed} failed")
EOF
exit $status

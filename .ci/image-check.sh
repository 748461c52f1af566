#!/usr/bin/env bash
# Build the container image for real and check it from inside.
#
#   .ci/image-check.sh    installs buildah and debootstrap when missing (apt-get; needs root),
#                         builds the image with `scripts/build-image --base local` (buildah; the
#                         build time and the image size are printed), then runs
#                         .ci/test_image.py against it: non-root user and file permissions,
#                         entrypoint, /health and /ready, a streamed chat proxied to a simulated
#                         worker, SIGTERM mid-stream (the stream finishes, exit 0), no compiler,
#                         pip cache or source tree, size bound.
#
# The local base is built once (debootstrap, about 2.5 min) and cached in
# ~/.cache/kvroute/image; buildah's layer cache lives in its store (/var/lib/containers), so a
# warm run rebuilds only what changed. KVROUTE_IMAGE_BASE=slim checks the python:3.11-slim base
# instead, where Docker Hub is reachable.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${KVROUTE_IMAGE_BASE:-local}"

log() { echo "image-check: $*" >&2; }

echo "== image"
missing=()
command -v buildah >/dev/null || missing+=(buildah)
[[ "$BASE" != local ]] || command -v debootstrap >/dev/null || missing+=(debootstrap)
if [[ ${#missing[@]} -gt 0 ]]; then
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    log "needs ${missing[*]} (Debian/Ubuntu: apt-get install ${missing[*]}, as root)"
    exit 1
  fi
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The checks run the image with `buildah run`, so build it with buildah even if a Docker
# engine is there. The full build log is shown only when the build fails.
build_log="$(mktemp)"
trap 'rm -f "$build_log"' EXIT
if ! image="$(KVROUTE_IMAGE_ENGINE=buildah bash "$ROOT/scripts/build-image" --base "$BASE" 2>"$build_log")"; then
  tail -60 "$build_log" >&2
  log "the image build failed"
  exit 1
fi
grep '^build-image:' "$build_log" >&2
cd "$ROOT"
KVROUTE_IMAGE="$image" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
  python -m pytest -q -p no:cacheprovider .ci/test_image.py

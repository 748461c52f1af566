# Sourced by scripts/demo and scripts/test: a project virtualenv with kvroute installed.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVROUTE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.kvroute-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e "$ROOT[test,bench,precise]"
  # xds-protos (Envoy's stubs) ships an old copy of opentelemetry-proto's modules; the
  # OTLP exporters need the real one, so it is installed last.
  python -m pip install -q --force-reinstall --no-deps opentelemetry-proto
  touch "$stamp"
fi
cd "$ROOT"

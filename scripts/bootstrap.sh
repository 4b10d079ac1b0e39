#!/usr/bin/env bash
# Create .venv and install verl_cppack with everything its tests and main job need.
# torch: if the venv has none, install torch==2.13.0 (the CPU build on this kind of machine) FIRST, so that
# nothing below pulls a multi-GB CUDA build; a torch that is already there is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
log="$(mktemp)"
run_pip() {
  if ! "${PIP[@]}" "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log"
    echo "bootstrap: pip install $* failed (full log: $log)" >&2
    exit 1
  fi
}
run_pip --upgrade pip  # the resolver of an old pip backtracks for many minutes over verl's dependencies
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  run_pip "torch==2.13.0"
fi
# Pinned integration targets (megatron-core 0.16.1 is the newest for Python 3.11; verl without extras), then
# the project itself without re-resolving its dependencies.
run_pip numpy "megatron-core==0.16.1" "verl==0.9.1" "ray[default]==2.60.0" "hypothesis>=6.100" "pytest>=8" matplotlib tqdm
run_pip --no-deps -e .
"$VENV/bin/python" -c "import torch, verl_cppack; print('verl_cppack', verl_cppack.__version__, 'torch', torch.__version__)"

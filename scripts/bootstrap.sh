#!/usr/bin/env bash
# Create .venv and install verl_cppack with everything its tests and main job need (`pip install -e .[all]`).
# torch: if the venv has none, install torch==2.13.0 (the CPU build on this kind of machine) FIRST, so that
# nothing below pulls a multi-GB CUDA build; a torch that is already there is left alone.
# A tree installed by this script is not re-checked: .venv/.bootstrap-<hash of pyproject.toml and this script>
# marks it, and a second run only prints what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
stamp="$VENV/.bootstrap-$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)"

if [ -f "$stamp" ]; then
  echo "bootstrap: $VENV is up to date (delete $stamp to reinstall)"
  exit 0
fi
step() { echo "bootstrap: $*"; }
[ -x "$VENV/bin/python" ] || { step "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
log="$(mktemp)"
run_pip() {
  if ! "${PIP[@]}" "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log"
    echo "bootstrap: pip install $* failed (full log: $log)" >&2
    exit 1
  fi
}
step "upgrading pip (an old resolver backtracks for minutes over verl's dependencies)"
run_pip --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  step "installing torch==2.13.0 (CPU build)"
  run_pip "torch==2.13.0"
fi
step "installing verl_cppack with the pinned CPU stack: verl 0.9.1, megatron-core 0.16.1, ray 2.60.0, mbridge, ... (first time: a few minutes, ~2 GB)"
run_pip -e ".[all]" "torch==$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])')"
"$VENV/bin/python" -c "import torch, verl, verl_cppack; print('bootstrap: ready: verl_cppack', verl_cppack.__version__, '| torch', torch.__version__, '| verl', verl.__version__)"
rm -f "$VENV"/.bootstrap-*
touch "$stamp"

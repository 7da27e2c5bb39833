# Sourced by scripts/test and scripts/demo: create .venv if missing and install pinned packages.
# torch goes first and pinned, so that nothing later pulls a multi-GB CUDA build.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
say() { echo "setup: $*" >&2; }  # progress on stderr: the first set-up takes minutes
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.dmap-setup-$(cat pyproject.toml scripts/requirements-pinned.txt | sha256sum | cut -c1-16)-${TORCH_SPEC//[^A-Za-z0-9.=]/_}"
pip_install() {
  # pip's own exit status decides (callers set -o pipefail); only its local-index noise is dropped
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
if [ ! -f "$stamp" ]; then
  say "installing $TORCH_SPEC (the largest download: a few minutes on a first run)..."
  pip_install "$TORCH_SPEC"
  say "installing the pinned packages (diffusers, transformers, accelerate, ...)..."
  pip_install -r scripts/requirements-pinned.txt "$TORCH_SPEC"
  say "installing dmap..."
  pip_install --no-deps -e .
  say "checking the imports..."
  .venv/bin/python -c "import torch, diffusers, transformers, accelerate, safetensors, typer, rich, dm_cli" \
    || { echo "setup failed: see the pip output above" >&2; exit 1; }
  rm -f .venv/.dmap-setup-*
  touch "$stamp"
  say "done."
fi
# Bytecode for dmap's own modules: an editable install has none, and where PYTHONDONTWRITEBYTECODE is set
# every dmap process would compile every module it imports from source again (~0.1 s a process).
.venv/bin/python -m compileall -q dm_cli > /dev/null || true

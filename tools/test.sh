#!/usr/bin/env bash
# Run hvd_dgc's tests (the README's test command). Uses the virtual environment
# made by tools/install.sh; extra arguments go to pytest (e.g. -k torch).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "no virtual environment at $VENV: run 'bash tools/install.sh' first" >&2
  exit 1
fi
export PATH="$VENV/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=3 OMPI_ALLOW_RUN_AS_ROOT=1 \
       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONDONTWRITEBYTECODE=1
cd "$REPO"
# hvd_dgc, the tests and the harness compiled once: every rank of every launch imports
# them (the installed packages come compiled), and with no bytecode written each
# process would compile them again.
"$VENV/bin/python" -m compileall -q -j 0 hvd_dgc tests harness > /dev/null
set +e
# The whole suite unless test files are named (tools/test.sh tests/tensorflow/test_tf.py -x).
targets=(tests)
for arg in "$@"; do
  case "$arg" in tests/*|tests) targets=() ;; esac
done
"$VENV/bin/python" -m pytest -ra --timeout=900 --durations=40 "$@" ${targets[@]+"${targets[@]}"}
rc=$?
set -e
# pytest's 5 means no test ran: that is a failure here.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"

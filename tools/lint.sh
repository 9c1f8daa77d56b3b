#!/usr/bin/env bash
# ruff (ruff.toml) and mypy (mypy.ini) over fp_dcp/; exits non-zero on any finding.
# Installs ruff and mypy where they are missing, into a virtual environment that
# sees the system's packages (mypy needs torch's types; nothing of torch or
# numpy is installed or changed): $LINT_VENV, default build/lint-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -m ruff --version >/dev/null 2>&1 || ! "$PY" -m mypy --version >/dev/null 2>&1; then
    venv=${LINT_VENV:-build/lint-venv}
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv --system-site-packages "$venv"
    fi
    PY=$venv/bin/python
    "$PY" -m ruff --version >/dev/null 2>&1 && "$PY" -m mypy --version >/dev/null 2>&1 \
        || "$PY" -m pip install -q ruff mypy
fi
"$PY" -m ruff --version
"$PY" -m ruff check fp_dcp
"$PY" -m mypy --version
"$PY" -m mypy --config-file mypy.ini

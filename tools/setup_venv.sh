#!/usr/bin/env bash
# Creates (or reuses) the project's Python 3.12 virtual environment in .venv and installs the
# package with its test and example dependencies at the pinned versions of tools/constraints.txt.
# Idempotent: a second run with an up-to-date .venv takes about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"

find_python312() {
    local candidates=()
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
    fi
    candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12
                 /usr/bin/python3.12 python3.12 python3)
    local py
    for py in "${candidates[@]}"; do
        # pyenv's shims exist but refuse to run unless selected: test by running them.
        if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            command -v "$py" || echo "$py"
            return 0
        fi
    done
    echo "setup_venv: no Python 3.12 interpreter found (megatron-core 0.19 needs 3.12)" >&2
    return 1
}

stamp="$venv/.installed-$(cat "$root/pyproject.toml" "$root/tools/constraints.txt" | sha1sum | cut -c1-12)"
if [[ -f "$stamp" ]]; then
    exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
    python="$(find_python312)"
    echo "setup_venv: creating $venv with $python" >&2
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -c "$root/tools/constraints.txt" -e "$root[test,examples]" >&2
rm -f "$venv"/.installed-*
touch "$stamp"
echo "setup_venv: $venv ready" >&2

#!/usr/bin/env bash
# SMG 1.13 (PyPI `smg`: the Rust PD gateway that replaced sglang-router), the peer every comparison runs beside
# sglang-router. Its own virtual environment, ~/.cache/pdgate/peers/smg (PDGATE_PEERS_DIR): sglang-router 0.3.2,
# in the gateway's environment, installs a `smg` command of its own, and one would overwrite the other.
# A second run finds it and returns at once.
set -euo pipefail
dir="${PDGATE_PEERS_DIR:-$HOME/.cache/pdgate/peers}/smg"
version="1.13.0"
if [ -x "$dir/bin/smg" ] && "$dir/bin/smg" --version 2>/dev/null | grep -q "$version"; then
    exit 0
fi
echo "installing smg==$version into $dir" >&2
python3 -m venv "$dir"
"$dir/bin/pip" install -q "smg==$version" 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$dir/bin/smg" --version | grep -q "$version" || { echo "smg did not install" >&2; exit 1; }

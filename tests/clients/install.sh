#!/usr/bin/env bash
# The agent CLIs the client tests run, from npm, pinned: Codex (Responses API) and Claude Code (Messages API).
# Installed once into ~/.cache/pdgate/clients (PDGATE_CLIENTS_DIR); a second run finds them and returns at once.
set -euo pipefail
dir="${PDGATE_CLIENTS_DIR:-$HOME/.cache/pdgate/clients}"
codex="@openai/codex@0.169.0"
claude="@anthropic-ai/claude-code@2.1.328"
have() { [ -x "$dir/node_modules/.bin/$1" ] && "$dir/node_modules/.bin/$1" --version 2>/dev/null | grep -q "$2"; }
if have codex 0.169.0 && have claude 2.1.328; then
    exit 0
fi
command -v npm >/dev/null || { echo "npm is needed to install the agent CLIs (node 20 or later)" >&2; exit 1; }
mkdir -p "$dir"
echo "installing $codex and $claude into $dir" >&2
npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "$codex" "$claude" >&2
have codex 0.169.0 || { echo "codex did not install" >&2; exit 1; }
have claude 2.1.328 || { echo "claude did not install (its native binary comes from an optional dependency)" >&2; exit 1; }

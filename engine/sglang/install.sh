#!/usr/bin/env bash
# Real SGLang 0.5.23 for CPU in its own virtual environment, ready for `pdgate up --cluster
# config/cluster.sglang-cpu.toml` and the real test tier. Idempotent: an environment that already has it takes
# seconds. Where: $PDGATE_ENGINES_HOME/sglang (default ~/.cache/pdgate/engines/sglang; ~3 GB). What it makes work:
# - torch: the CPU build 2.13.0+cpu (SGLang pins 2.14.1, whose PyPI wheel is the CUDA build with ~3 GB of nvidia
#   packages); pip finds it through this machine's configuration, elsewhere through PyTorch's CPU index
#   (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu);
# - sglang==0.5.23 with --no-deps, and the requirements a CPU serve imports (engine/sglang/requirements-cpu.txt):
#   its GPU kernels have no CPU build; engine/sglang/cpu.py stands in for the one kernel the CPU path calls and
#   for torchvision, in every SGLang process, at start (nothing installed is edited);
# - mooncake over TCP for the KV transfer (PyPI mooncake-transfer-engine-non-cuda; the system's libibverbs1 and
#   librdmacm1, which the README's test command installs with apt);
# - the tiny model (engine.model) built once into $PDGATE_ENGINES_HOME/models/tiny-llama.
# The check at the end starts no server: it applies fixes A/B/C and the CPU profile, each against the installed
# source, and imports SGLang's server (python -m engine.sglang.worker --pdgate-check).
set -euo pipefail
cd "$(dirname "$0")/../.."
home="${PDGATE_ENGINES_HOME:-$HOME/.cache/pdgate/engines}"
venv="$home/sglang"
want="0.5.23"
t0=$(date +%s)
# pip's resolver names every GPU requirement left out, on purpose: not shown
quiet() { grep -vE "^WARNING: (Location|Skipping)|^ERROR: pip's dependency resolver|^sglang $want requires" || true; }
check() {
    SGLANG_USE_CPU_ENGINE=1 PDGATE_KERNEL_PROFILE=cpu PYTHONPATH="$PWD" "$venv/bin/python" -m engine.sglang.worker \
        --pdgate-check >/dev/null 2>"$home/sglang-check.log"
}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$want')" 2>/dev/null && check; then
    echo "real SGLang $want: already installed in $venv"
else
    echo "installing real SGLang $want for CPU into $venv (a few minutes, ~3 GB)"
    mkdir -p "$home"
    [ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==2.13.0+cpu" 2>&1 | quiet
    "$venv/bin/pip" install -q --no-deps "sglang==$want" 2>&1 | quiet
    "$venv/bin/pip" install -q -r engine/sglang/requirements-cpu.txt "torch==2.13.0+cpu" 2>&1 | quiet
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
    check || { echo "real SGLang did not install: the worker's check failed:" >&2; tail -5 "$home/sglang-check.log" >&2; exit 1; }
fi
"$venv/bin/python" -m engine.model --out "$home/models/tiny-llama" >/dev/null 2>&1 \
    || { echo "could not build the tiny model (python -m engine.model)" >&2; exit 1; }
echo "real SGLang ready: $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv, model in $home/models/tiny-llama ($(( $(date +%s) - t0 )) s)"

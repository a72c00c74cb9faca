#!/usr/bin/env bash
# Build the GPU kit: the wheels that the lent GPU machine (offline, Python 3.12, its own torch)
# lacks for ComfyUI 0.3.75 + this pack + tests/. It travels as a carried path, so it is capped.
#
#   tools/gpu_kit.sh [--python-version 3.12] [--dest .gpu_kit/wheels]
#   on the GPU machine: python3 -m pip install --no-index --no-deps .gpu_kit/wheels/*.whl
#
# --python-version 3.11 rehearses on this machine (same versions, cp311 wheels).
# GPU_KIT_BUDGET_MIB (default 35): repo + .comfyui/ + kit must stay under the 64 MiB carry limit.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYVER=3.12
DEST=$REPO/.gpu_kit/wheels
BUDGET_MIB=${GPU_KIT_BUDGET_MIB:-35}
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) PYVER=${2:?}; shift 2 ;;
    --dest) DEST=${2:?}; shift 2 ;;
    *) echo "usage: $0 [--python-version X.Y] [--dest DIR]" >&2; exit 2 ;;
  esac
done
case $PYVER in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "bad --python-version: $PYVER" >&2; exit 2 ;; esac
ABI=cp${PYVER/./}
PY=${PYTHON:-python3}

# Build into a fresh folder and swap it in at the end: re-runs are idempotent (pip's cache
# makes them cheap) and a changed pin or Python version never leaves a stale wheel behind.
TMP=$DEST.tmp
rm -rf "$TMP"
mkdir -p "$TMP"

# Wheels only, for the GPU machine's interpreter rather than this one. --no-deps: the image
# already has the common dependencies, and anything it lacks is pinned in the list instead.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$TMP" -r "$REPO/tools/gpu-kit-requirements.txt"

# PyAV is imported by comfy_api.latest at ComfyUI start-up, but its wheel (bundled ffmpeg,
# ~34 MiB) alone would fill the budget. Build an import-only stand-in: start-up and every
# non-video node work; anything that really uses av fails with a message naming this kit.
"$PY" - "$TMP" <<'EOF'
import base64, hashlib, sys, zipfile
out = sys.argv[1]
name, ver = "av", "0.0.0+gpukit"
msg = "av is an import-only stand-in from tools/gpu_kit.sh (the real wheel is too big for the GPU kit)"
getattr_src = (f"def __getattr__(name):\n"
               f"    raise AttributeError(f'{msg}: no {{__name__}}.{{name}}')\n")
files = {
    "av/__init__.py": f'"""{msg}."""\n__version__ = "{ver}"\n' + getattr_src,
    "av/container.py": "class InputContainer: pass\nclass OutputContainer: pass\n" + getattr_src,
    "av/subtitles/__init__.py": getattr_src,
    "av/subtitles/stream.py": "class SubtitleStream: pass\n" + getattr_src,
}
di = f"{name}-{ver}.dist-info"
files[f"{di}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\nSummary: {msg}\n"
files[f"{di}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: gpu_kit.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
record = "".join(f"{p},{digest(s.encode())},{len(s.encode())}\n" for p, s in files.items())
files[f"{di}/RECORD"] = record + f"{di}/RECORD,,\n"
# Fixed timestamps: the same script makes the same bytes.
with zipfile.ZipFile(f"{out}/{name}-{ver}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
    for p, s in files.items():
        z.writestr(zipfile.ZipInfo(p, (2020, 1, 1, 0, 0, 0)), s)
EOF

rm -rf "$DEST"
mv "$TMP" "$DEST"

ls -l "$DEST"
BYTES=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "GPU kit (cp${PYVER/./}): $(ls "$DEST"/*.whl | wc -l) wheels, $BYTES bytes ($((BYTES / 1048576)) MiB) in $DEST"
if [ "$BYTES" -gt $((BUDGET_MIB * 1048576)) ]; then
  echo "GPU kit is over its budget of $BUDGET_MIB MiB" >&2
  exit 1
fi

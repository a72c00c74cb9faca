#!/usr/bin/env bash
# Build the GPU kit: the wheels that the lent GPU machine (offline, Python 3.12, its own torch)
# lacks for ComfyUI 0.3.75 + this pack + tests/. It travels as a carried path, so it is capped.
#
#   tools/gpu_kit.sh [--python-version 3.12] [--dest .gpu_kit/wheels]
#   on the GPU machine: python3 -m pip install --no-index --no-deps .gpu_kit/wheels/*.whl
#
# --python-version 3.11 rehearses on this machine (same versions, cp311 wheels).
# GPU_KIT_BUDGET_MIB (default 35): repo + .comfyui/ + kit must stay under the 64 MiB carry limit.
#
# Beside it, for ComfyUI 0.33 with Dynamic VRAM (a device call of its own, carrying .gpu_kit
# without .comfyui/): .gpu_kit/comfyui-033/ holds the 0.33 tree as a tarball (from .comfyui-033/,
# or COMFY033_TREE) and the wheels 0.33 needs on top of wheels/: comfy-aimdo (Dynamic VRAM
# itself) and comfy-kitchen without its compiled kernels (see below), from
# tools/gpu-kit-033-requirements.txt. GPU_KIT_033_BUDGET_MIB (default 24) caps that part.
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
# ComfyUI 0.33 reads members of these enums at import time (comfy_api's video types): any
# member is a distinct name.
enums_src = ("class _Members(type):\n"
             "    def __getattr__(cls, name):\n"
             "        if name.startswith('__'):\n"
             "            raise AttributeError(name)\n"
             "        return f'{cls.__name__}.{name}'\n"
             "class ColorPrimaries(metaclass=_Members): pass\n"
             "class ColorRange(metaclass=_Members): pass\n"
             "class ColorTrc(metaclass=_Members): pass\n")
files = {
    "av/__init__.py": f'"""{msg}."""\n__version__ = "{ver}"\n' + getattr_src,
    "av/container.py": "class InputContainer: pass\nclass OutputContainer: pass\n" + getattr_src,
    "av/subtitles/__init__.py": getattr_src,
    "av/subtitles/stream.py": "class SubtitleStream: pass\n" + getattr_src,
    "av/video/__init__.py": getattr_src,
    "av/video/reformatter.py": enums_src + getattr_src,
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

# ---- ComfyUI 0.33 (Dynamic VRAM): its tree and the wheels it needs on top of the kit above.
KIT=$(dirname "$DEST")
DEST033=$KIT/comfyui-033
TREE033=${COMFY033_TREE:-$REPO/.comfyui-033}
BUDGET033_MIB=${GPU_KIT_033_BUDGET_MIB:-24}
TMP033=$DEST033.tmp
rm -rf "$TMP033"
mkdir -p "$TMP033"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$TMP033" -r "$REPO/tools/gpu-kit-033-requirements.txt"

# comfy-kitchen's wheel is 56 MiB, 55 of them its compiled CUDA and ROCm kernels: over the
# budget alone. Without them kitchen loads its triton and eager backends (it says so at start-up)
# and every op still runs; only the speed of quantized formats differs, which no test or
# benchmark of the kit compares. The trimmed wheel says so in its version (+gpukit.nokernels).
"$PY" - "$TMP033" <<'EOF'
import base64, glob, hashlib, os, re, sys, zipfile
out = sys.argv[1]
src = glob.glob(os.path.join(out, "comfy_kitchen-*.whl"))
assert len(src) == 1, src
src = src[0]
old_ver = re.match(r"comfy_kitchen-([^-]+)-", os.path.basename(src)).group(1)
ver = old_ver + "+gpukit.nokernels"
drop = re.compile(r"^comfy_kitchen/backends/(cuda|hip)/_C[^/]*\.(so|pyd)$")
def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
files = {}
with zipfile.ZipFile(src) as z:
    for info in z.infolist():
        name = info.filename
        if drop.match(name) or name.endswith("/RECORD"):
            continue
        data = z.read(name)
        name = name.replace(f"comfy_kitchen-{old_ver}.dist-info/", f"comfy_kitchen-{ver}.dist-info/")
        if name.endswith(".dist-info/METADATA"):
            data = re.sub(rb"(?m)^Version: .*$", f"Version: {ver}".encode(), data, count=1)
        files[name] = data
di = f"comfy_kitchen-{ver}.dist-info"
record = "".join(f"{n},{digest(d)},{len(d)}\n" for n, d in files.items()) + f"{di}/RECORD,,\n"
files[f"{di}/RECORD"] = record.encode()
target = os.path.join(out, os.path.basename(src).replace(f"-{old_ver}-", f"-{ver}-"))
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
    for n, d in files.items():
        z.writestr(zipfile.ZipInfo(n, (2020, 1, 1, 0, 0, 0)), d)
os.remove(src)
EOF
# The tree `make env-033` unpacked (ComfyUI/ inside, as in ../shared/comfyui's tarball), without
# bytecode or git history.
if [ -f "$TREE033/comfy/model_patcher.py" ]; then
  mkdir -p "$TMP033/tree" && ln -s "$(cd "$TREE033" && pwd -P)" "$TMP033/tree/ComfyUI"
  tar -czhf "$TMP033/comfyui-0.33.tar.gz" -C "$TMP033/tree" --exclude=__pycache__ --exclude=.git ComfyUI
  rm -rf "$TMP033/tree"
else
  echo "no ComfyUI 0.33 tree at $TREE033 (make env-033): the 0.33 stages of bench/gpu_session.sh cannot run" >&2
fi
rm -rf "$DEST033"
mv "$TMP033" "$DEST033"

ls -l "$DEST"
BYTES=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "GPU kit (cp${PYVER/./}): $(ls "$DEST"/*.whl | wc -l) wheels, $BYTES bytes ($((BYTES / 1048576)) MiB) in $DEST"
if [ "$BYTES" -gt $((BUDGET_MIB * 1048576)) ]; then
  echo "GPU kit is over its budget of $BUDGET_MIB MiB" >&2
  exit 1
fi
ls -l "$DEST033"
BYTES033=$(du -cb "$DEST033"/* | tail -1 | cut -f1)
echo "GPU kit for ComfyUI 0.33: $BYTES033 bytes ($((BYTES033 / 1048576)) MiB) in $DEST033"
if [ "$BYTES033" -gt $((BUDGET033_MIB * 1048576)) ]; then
  echo "GPU kit's 0.33 part is over its budget of $BUDGET033_MIB MiB" >&2
  exit 1
fi

#!/usr/bin/env bash
# Build the GPU kit: everything a GPU machine (offline, Python 3.12, its own torch) lacks
# to run bench/gpu_session.sh, in .gpu_kit/, the one path both of its calls carry
# (docs/gpu-session.md):
#   wheels/                 the wheels ComfyUI 0.3.75 + this pack + tests/ need
#                           (tools/gpu-kit-requirements.txt)
#   comfyui-0.3.75.tar.gz   the 0.3.75 tree (from .comfyui/, or COMFY_TREE), without bytecode
#   comfyui-033/            ComfyUI 0.33 with Dynamic VRAM: its tree as a tarball (from
#                           .comfyui-033/, or COMFY033_TREE) and the wheels 0.33 needs on top of
#                           wheels/: comfy-aimdo (Dynamic VRAM itself), comfy-kitchen without its
#                           compiled kernels (see below), ... (tools/gpu-kit-033-requirements.txt)
# The session unpacks the wheels onto PYTHONPATH (no pip) and the trees outside the checkout.
#
#   tools/gpu_kit.sh [--python-version 3.12] [--dest .gpu_kit/wheels]
#
# --python-version 3.11 builds cp311 wheels of the same versions. GPU_KIT_BUDGET_MIB (default
# 56): the whole kit; with the checkout (about 2 MiB) it must stay under the 64 MiB a device
# call carries, and the trees travel as tarballs so that no bytecode a test run left in them
# can push it over.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYVER=3.12
DEST=$REPO/.gpu_kit/wheels
BUDGET_MIB=${GPU_KIT_BUDGET_MIB:-56}
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

# pack_tree TREE TARBALL: the ComfyUI tree as TARBALL, unpacking to ComfyUI/ (as
# ../shared/comfyui's tarball does), without bytecode or git history.
pack_tree() {
  local tree=$1 tarball=$2 stage
  stage=$(mktemp -d)
  ln -s "$(cd "$tree" && pwd -P)" "$stage/ComfyUI"
  tar -czhf "$tarball" -C "$stage" --exclude=__pycache__ --exclude=.git ComfyUI
  rm -rf "$stage"
}

KIT=$(dirname "$DEST")
# ---- ComfyUI 0.3.75: the tree `make env` unpacked.
TREE0375=${COMFY_TREE:-$REPO/.comfyui}
if [ -f "$TREE0375/comfy/model_patcher.py" ]; then
  pack_tree "$TREE0375" "$KIT/comfyui-0.3.75.tar.gz.tmp"
  mv "$KIT/comfyui-0.3.75.tar.gz.tmp" "$KIT/comfyui-0.3.75.tar.gz"
else
  echo "no ComfyUI 0.3.75 tree at $TREE0375 (make env): bench/gpu_session.sh first cannot run" >&2
  exit 1
fi

# ---- ComfyUI 0.33 (Dynamic VRAM): its tree and the wheels it needs on top of the kit above.
DEST033=$KIT/comfyui-033
TREE033=${COMFY033_TREE:-$REPO/.comfyui-033}
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
# The tree `make env-033` unpacked.
if [ -f "$TREE033/comfy/model_patcher.py" ]; then
  pack_tree "$TREE033" "$TMP033/comfyui-0.33.tar.gz"
else
  echo "no ComfyUI 0.33 tree at $TREE033 (make env-033): bench/gpu_session.sh dynamic cannot run" >&2
fi
rm -rf "$DEST033"
mv "$TMP033" "$DEST033"

ls -lR "$KIT"
BYTES=$(find "$KIT" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
echo "GPU kit (cp${PYVER/./}): $BYTES bytes ($((BYTES / 1048576)) MiB) in $KIT"
if [ "$BYTES" -gt $((BUDGET_MIB * 1048576)) ]; then
  echo "GPU kit is over its budget of $BUDGET_MIB MiB" >&2
  exit 1
fi

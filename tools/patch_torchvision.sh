#!/usr/bin/env bash
# torchvision 0.28.0's only wheel is CUDA-built. Next to CPU torch its C ops cannot load and two
# unconditional fake-op registrations abort `import torchvision`, which ComfyUI needs at start-up.
# Make those registrations conditional. Idempotent.
set -euo pipefail
PY=${1:?usage: patch_torchvision.sh PYTHON}
TV=$("$PY" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torchvision').origin))")
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::q?nms")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$TV/_meta_registrations.py"
"$PY" -W ignore -c "import torchvision.transforms"

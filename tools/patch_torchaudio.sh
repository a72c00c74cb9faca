#!/usr/bin/env bash
# torchaudio 2.11.0 (newest on PyPI; no torch pin in its metadata) is a CUDA (cu130) build: its
# torchaudio/lib/_torchaudio.abi3.so needs libc10_cuda.so, so with torch 2.13.0+cpu `import torchaudio`
# dies with "OSError: Could not load this library: .../_torchaudio.abi3.so".
# ComfyUI 0.33 imports torchaudio unconditionally (comfy/sd.py -> comfy/ldm/lightricks/vae/audio_vae.py);
# 0.3.75 needs it for its audio nodes (comfy_extras/nodes_audio.py, nodes_audio_encoder.py).
# Skip the extension when torch has no CUDA; the pure-torch functional/transforms API keeps working. Idempotent.
set -euo pipefail
PY=${1:-python}
TA=$("$PY" -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('torchaudio').origin))")
sed -i -E 's/^_IS_TORCHAUDIO_EXT_AVAILABLE = _load_lib\("_torchaudio"\)$/_IS_TORCHAUDIO_EXT_AVAILABLE = bool(torch.version.cuda) and _load_lib("_torchaudio")/' "$TA/_extension/__init__.py"
"$PY" -W ignore -c "import torch, torchaudio, torchaudio.functional as F; F.resample(torch.zeros(1,160),16000,8000); print('torchaudio', torchaudio.__version__, 'import OK, C ext:', torchaudio._extension._IS_TORCHAUDIO_EXT_AVAILABLE)"

"""Which optional fixture models this ComfyUI loads at all (e.g. a small Flux only loads where
the tree sizes Flux's heads from its shapes), learnt by loading each with the tree's own
`comfy.sd.load_diffusion_model` in a subprocess of the tree's Python, never from a version
number. It runs beside the servers' start-up, so it costs no extra wall time.
"""
from __future__ import annotations

import json
import os
import subprocess

from comfy_server import COMFY_PYTHON, COMFY_ROOT

from .catalogue import Catalogue

SCRIPT = """
import json, sys
sys.argv = ["probe", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd
result = {}
for name, path in json.loads(sys.stdin.read()):
    try:
        comfy.sd.load_diffusion_model(path)
        result[name] = "ok"
    except Exception as e:
        result[name] = f"{type(e).__name__}: {e}"[:300]
print("PROBE " + json.dumps(result))
"""


def start(cat: Catalogue) -> tuple[subprocess.Popen, str] | None:
    optional = [(m.name, str(cat.root / m.folder / m.filename)) for m in cat.models if m.optional]
    if not optional:
        return None
    proc = subprocess.Popen([COMFY_PYTHON, "-c", SCRIPT], cwd=COMFY_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, json.dumps(optional)


def finish(started: tuple[subprocess.Popen, str] | None, cat: Catalogue, timeout: float = 600) -> dict[str, str]:
    """Exclude the optional models that did not load; return {name: why}."""
    if started is None:
        return {}
    proc, payload = started
    output, _ = proc.communicate(payload, timeout=timeout)
    line = next((l for l in output.splitlines() if l.startswith("PROBE ")), None)
    if line is None:
        raise RuntimeError(f"the model probe printed no result:\n{output[-3000:]}")
    reasons = {name: why for name, why in json.loads(line[len("PROBE "):]).items() if why != "ok"}
    cat.excluded.extend(name for name in reasons if name not in cat.excluded)
    return reasons

"""Write the demo's models into an existing ComfyUI, so that the pack's example workflows run there.

The example workflows (example_workflows/, and their API forms in example_workflows/api/) load two
random-weight models that `make demo` writes for its own server: a small HunyuanVideo-shaped
diffusion model and a CLIP-L text encoder (tools/example_workflows.py, MODELS). This writes the
same files into the `models/` folder of a ComfyUI of yours, where core's loaders look; a file
already there is kept. Run it with the Python of that ComfyUI (it needs torch and safetensors):

    python tools/demo_models.py /path/to/ComfyUI              # writes into /path/to/ComfyUI/models
    python tools/demo_models.py --models-dir /path/to/models  # a models folder elsewhere

The registry archive leaves tools/ out: run it from a clone of the pack.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import example_workflows  # noqa: E402

MiB = 2**20


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("comfyui", nargs="?", type=Path, help="the ComfyUI folder (its models/ is used)")
    where.add_argument("--models-dir", type=Path, help="a ComfyUI models folder")
    args = ap.parse_args(argv)
    if args.models_dir is not None:
        models = args.models_dir
    else:
        if not (args.comfyui / "main.py").is_file():
            print(f"{args.comfyui} is not a ComfyUI folder (no main.py); give the ComfyUI folder, "
                  f"or a models folder with --models-dir", file=sys.stderr)
            return 2
        models = args.comfyui / "models"
    models = models.resolve()
    written = set(example_workflows.write_models_into(models))
    for (folder, name), what in example_workflows.MODELS.items():
        path = models / folder / name
        state = "written" if path in written else "already there, kept"
        print(f"{path}: {what} ({path.stat().st_size / MiB:.1f} MiB), {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

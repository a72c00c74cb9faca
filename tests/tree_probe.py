"""What a probe script needs to run inside the ComfyUI tree under test (`run_tree_script` runs it
as `PYTHON SCRIPT OUT.json --comfyui ROOT`): ComfyUI importable from that tree and parsing a
`--cpu` command line, and the pack's modules importable as a package without its server wiring.
"""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def start() -> Path:
    """Set up ComfyUI from the tree named on the command line; returns the output path."""
    out, root = Path(sys.argv[1]), Path(sys.argv[sys.argv.index("--comfyui") + 1]).resolve()
    sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI parses the command line when comfy.cli_args loads
    for path in (root, TESTS / "fixtures"):
        sys.path.insert(0, str(path))
    import comfy.options

    comfy.options.enable_args_parsing()
    return out


def import_pack_module(name: str):
    """A module of the pack (``"nodes.layerwise.node"``) as part of a package."""
    for pkg, path in (("tiered_offload_probe", REPO), ("tiered_offload_probe.nodes", REPO / "nodes")):
        if pkg not in sys.modules:
            module = types.ModuleType(pkg)
            module.__path__ = [str(path)]
            sys.modules[pkg] = module
    return importlib.import_module(f"tiered_offload_probe.{name}")

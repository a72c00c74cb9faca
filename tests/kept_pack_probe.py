"""Probe: Apply Layerwise Offload's kept pack survives ComfyUI moving the blocks between runs.

Run by tests/test_kept_pack.py in the tree under test (`run_tree_script`). The model comes from
core's loader and is sampled through core's `comfy.sample.sample` with the node's patcher, on
the CPU. Between runs the probe leaves the
block tensors where ComfyUI's own load of the same model (a prompt without the node) leaves
them: the same Parameter objects over other memory. On a GPU that is device memory; this
machine has none, so a fresh host copy stands in (what a device round trip or a partial
unload's per-module `.to()` leaves, too). Then either:
- core unloads the model: the root module's `.to("cpu")`, as `ModelPatcher.unpatch_model` does;
  recorded: whether the tensors point into the kept pack again right after it;
- or the node's next run starts with the blocks still there (its hand-over from core);
- or core loads the model itself (a prompt without the node) and then, under memory pressure,
  unloads part of it with its own `partially_unload`, which moves module by module with each
  module's `.to()`; recorded: for every block tensor, whether it points into the kept pack again
  and whether core moved its module.
Each case records how many units the next run packed again (0 when the kept pack survived) and
whether the result is the first run's.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import tree_probe

OUT = tree_probe.start()
import torch  # noqa: E402

import comfy.model_management  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
import tiny_models  # noqa: E402


def main() -> None:
    layerwise = tree_probe.import_pack_module("nodes.layerwise.node")
    state = tree_probe.import_pack_module("nodes.core.state")
    path = Path(tempfile.mkdtemp()) / "wan.safetensors"
    tiny_models.write_tiny_wan21(path, layers=4)
    patcher = comfy.sd.load_diffusion_model(str(path))
    model = layerwise.ApplyLayerwiseOffload.execute(patcher, resident_blocks=1, vram_budget_gb=0.0,
                                                    prefetch=1, pin=True)[0]
    blocks = model.model.diffusion_model.blocks
    g = torch.Generator().manual_seed(0)
    positive = [[torch.randn(1, 8, 4096, generator=g), {}]]
    negative = [[torch.randn(1, 8, 4096, generator=g), {}]]
    latent = torch.zeros(1, 16, 1, 8, 8)

    def run() -> dict:
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
        out = comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", positive, negative, latent,
                                  disable_pbar=True, seed=1)
        report = next(r for r in state.LAYERWISE.report()
                      if r["module_id"] == id(model.model.diffusion_model))
        return {"sha": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
                "packed": report["telemetry"]["blocks_packed"]}

    def moved_by_core() -> None:
        with torch.no_grad():
            for p in blocks.parameters():
                p.data = p.data.clone()

    def in_pack() -> bool:
        return [p.data_ptr() for p in blocks.parameters()] == pack_pointers

    first = run()
    pack_pointers = [p.data_ptr() for p in blocks.parameters()]  # after a run they alias the kept pack
    cases = {}
    for name, unload in (("core_unload", True), ("next_run_hands_over", False)):
        moved_by_core()
        case = {"moved": not in_pack()}
        if unload:
            model.model.to("cpu")
            case["back_in_pack_after_unload"] = in_pack()
        case.update(run(), back_in_pack_after_run=in_pack())
        cases[name] = case
    cases["partial_unload"] = partial_unload(patcher, blocks, moved_by_core, pack_pointers, run)
    OUT.write_text(json.dumps({"first": first, "cases": cases}))


def partial_unload(patcher, blocks, moved_by_core, pack_pointers, run) -> dict:
    """Core loads the model without the node, then frees about half the blocks' bytes with its
    `partially_unload` (smallest modules first); then it unloads the model and the node runs."""
    comfy.model_management.load_models_gpu([patcher])
    moved_by_core()
    block_bytes = sum(p.nbytes for p in blocks.parameters())
    freed = patcher.partially_unload(patcher.offload_device, memory_to_free=block_bytes // 2)
    rows = []
    for (name, p), home in zip(blocks.named_parameters(), pack_pointers):
        module = blocks.get_submodule(name.rpartition(".")[0])
        rows.append({"name": name, "in_pack": p.data_ptr() == home,
                     "unloaded_by_core": getattr(module, "comfy_patched_weights", None) is False})
    comfy.model_management.unload_all_models()
    return {"freed": freed, "block_bytes": block_bytes, "tensors": rows, **run(),
            "back_in_pack_after_run": [p.data_ptr() for p in blocks.parameters()] == pack_pointers}


if __name__ == "__main__":
    main()

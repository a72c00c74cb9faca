"""Every tiny fixture model samples through a real server and /prompt, deterministically."""
import pytest

import tiny_models
from workflows import latent_sha, sample_workflow


@pytest.mark.parametrize("kind", sorted(tiny_models.MODELS))
def test_tiny_model_samples_deterministically(comfy, kind):
    wf = sample_workflow(kind)
    first = comfy.run(wf)
    second = comfy.run(wf)
    info = first["stats"]["latent_stats"][0]
    assert info["finite"]
    assert info["shape"] == tiny_models.MODELS[kind]["latent"]["shape"]
    assert latent_sha(first) == latent_sha(second)


def test_pack_nodes_are_registered(comfy):
    info = comfy.get("/object_info/ApplyLayerwiseOffload")["ApplyLayerwiseOffload"]
    assert info["python_module"].startswith("custom_nodes")
    assert set(info["input"]["required"]) >= {"model", "resident_blocks", "vram_budget_gb",
                                             "prefetch", "pin"}

"""torch.compile with streamed blocks, through a real ComfyUI server (inductor's C++ backend on
the CPU, with PyTorch's attention as on a GPU, so that core's compile of the whole model is one
graph): what the node runs compiled gives the bits the same compiled workflow gives without it.

A compile of each block on its own (core's compile wrapper with one key per block, as the
per-block compile nodes of KJNodes use it, or a compiled module put in for each block by an
object patch) streams bit-identically, LoRA, strength change, interrupt and disk included, and the
streamed blocks run compiled: dynamo's own counters, read in the server after every model call
(tests/comfy_test_nodes: TieredTestCompileCounts), show that no pass after a prompt's first
compiles anything, that a prompt of a setup already run compiles nothing, that the only graph
breaks the node adds are its hooks between blocks, and that it adds no graph of the blocks. A
compile of the whole diffusion model (core's TorchCompileModel) would be split at every streamed
block, which changes inductor's results: it is refused, with the other setups
nodes/layerwise/compiled_models.py refuses, before anything moves; with every block resident it
keeps its one graph.

Compiling on a CPU is slow: one server for the module, two tiny Wans of the same block shape (so
their blocks share graphs), and refusals that never reach a compile.
"""
from __future__ import annotations

import copy

import pytest

import tiny_models
from comfy_server import ComfyServer
from workflows import latent_sha, sample_workflow
from ws_interrupt import queue_and_interrupt

STREAMED = {"resident_blocks": 0, "prefetch": 1}
WAN6 = "compile_wan6.safetensors"
WAN6_LORA = "compile_wan6_lora.safetensors"
PER_BLOCK = "core_wrapper_block_keys"
# Graph breaks the node may add: dynamo meets its hooks (offload_core/device/hooks.py).
ENGINE_BREAKS = ("offload_enter", "offload_exit")


@pytest.fixture(scope="module")
def server(tmp_path_factory, comfy_base):
    """A server of its own, so dynamo's counters and caches hold only this module's compiles."""
    models = comfy_base / "models"
    if not (models / "diffusion_models" / WAN6).exists():
        tiny_models.write_tiny_wan21(models / "diffusion_models" / WAN6, layers=6, seed=61)
    if not (models / "loras" / WAN6_LORA).exists():
        tiny_models.write_tiny_wan_lora(models / "loras" / WAN6_LORA, model_layers=6, seed=63)
    base = tmp_path_factory.mktemp("compile_base")
    (base / "models").symlink_to(models, target_is_directory=True)
    comfy = ComfyServer(base, extra_args=("--use-pytorch-cross-attention",)).start()
    yield comfy
    comfy.stop()


def wan(lora: float | None = 1.0, layerwise: dict | None = None, six: bool = False) -> dict:
    wf = sample_workflow("wan21", lora_strength=lora, layerwise=layerwise)
    if six:
        wf["load"]["inputs"]["unet_name"] = WAN6
        if lora is not None:
            wf["lora"]["inputs"]["lora_name"] = WAN6_LORA
    return wf


def insert(wf: dict, node_id: str, class_type: str, taker: str = "sample", **inputs) -> dict:
    """``wf`` with a MODEL pass-through node right before ``taker``, fed by what fed it."""
    out = copy.deepcopy(wf)
    out[node_id] = {"class_type": class_type, "inputs": {"model": out[taker]["inputs"]["model"], **inputs}}
    out[taker]["inputs"]["model"] = [node_id, 0]
    return out


def core_compile(wf: dict, before_offload: bool = False) -> dict:
    """Core's TorchCompileModel right before the offload node, or right before the sampler."""
    taker = "offload" if before_offload and "offload" in wf else "sample"
    return insert(wf, "compile", "TorchCompileModel", taker, backend="inductor")


def block_compile(wf: dict, how: str = PER_BLOCK, backend: str = "inductor", mode: str = "default",
                  fullgraph: bool = False, dynamic: str = "auto") -> dict:
    return insert(wf, "compile", "TieredTestCompileBlocks", how=how, backend=backend, mode=mode,
                  fullgraph=fullgraph, dynamic=dynamic)


def run(comfy, wf: dict) -> tuple[str, dict]:
    """The latent's sha256 and dynamo's counts of the run."""
    counted = insert(wf, "counts", "TieredTestCompileCounts")
    counted["report"] = {"class_type": "TieredTestCompileReport",
                         "inputs": {"model": ["counts", 0], "samples": ["sample", 0]}}
    outputs = comfy.run(counted, timeout=900)
    return latent_sha(outputs), outputs["report"]["compile_counts"][0]


def assert_graphs_reused(report: dict, since: dict | None = None) -> None:
    """No pass after the first compiled anything; with ``since`` (the counts after an earlier
    prompt of the same setup) not even the first. (The first pass of a prompt may: a graph that
    guards on the size of core's wrapper table, which the node adds its wrappers to, is compiled
    once more for it.)"""
    passes = report["passes"]
    assert len(passes) >= 4 and all(p == passes[0] for p in passes), passes
    if since is not None:
        assert passes[0] == since, (since, passes)


def engine_breaks_only(before: dict, after: dict) -> None:
    """The graph breaks that appeared between two reports are all the engine's hooks."""
    added = set(after["break_reasons"]) - set(before["break_reasons"])
    assert all(any(word in reason for word in ENGINE_BREAKS) for reason in added), added


def test_per_block_compile_streams_bit_identical_and_reuses_its_graphs(server):
    full, ref = run(server, block_compile(wan(1.0)))
    half, _ = run(server, block_compile(wan(0.5)))
    plain, _ = run(server, wan(1.0))
    assert len({full, half, plain}) == 3, "the LoRA strength and compile must change the result"
    assert ref["block_graphs"]["WanAttentionBlock"] >= 1

    sha, report = run(server, block_compile(wan(1.0, STREAMED)))
    assert sha == full
    assert_graphs_reused(report)
    assert report["block_graphs"]["WanAttentionBlock"] >= 1  # the streamed blocks ran compiled
    state = server.get("/offload/layerwise")["models"][-1]
    assert state["streamed_indices"] == [0, 1] and state["telemetry"]["copies"] > 0
    # A strength change, one resident block: the same graphs, core's bits.
    last = report["total"]
    for wf, expected in ((block_compile(wan(0.5, STREAMED)), half),
                         (block_compile(wan(1.0, {"resident_blocks": 1, "prefetch": 1})), full)):
        sha, report = run(server, wf)
        assert sha == expected, wf["offload"]["inputs"]
        assert_graphs_reused(report, last)
    # fullgraph on, and dynamic off (KJNodes' default).
    for options in ({"fullgraph": True}, {"dynamic": "false"}):
        reference, _ = run(server, block_compile(wan(1.0), **options))
        sha, report = run(server, block_compile(wan(1.0, STREAMED), **options))
        assert sha == reference, options
        assert_graphs_reused(report)
        engine_breaks_only(ref, report)
    # Later prompts without the node are core's.
    assert run(server, block_compile(wan(1.0)))[0] == full
    assert run(server, wan(1.0))[0] == plain


def test_blocks_compiled_by_object_patches_stream_bit_identical(server):
    reference, before = run(server, block_compile(wan(None), "blocks_by_object_patch"))
    sha, report = run(server, block_compile(wan(None, STREAMED), "blocks_by_object_patch"))
    assert sha == reference
    assert_graphs_reused(report)
    engine_breaks_only(before, report)
    # Other settings make a new engine session while core still holds the model with its object
    # patches applied (compiled modules in the block list): it finds and streams the blocks.
    sha, again = run(server, block_compile(wan(None, {"resident_blocks": 1, "prefetch": 2}),
                                           "blocks_by_object_patch"))
    assert sha == reference
    assert_graphs_reused(again, report["total"])
    # Core applies no LoRA under a module an object patch compiled (its weight names pass through
    # torch.compile's wrapper): the node refuses to merge one there, resident blocks included.
    # (While core holds the model with those object patches applied, its LoRA loader finds no
    # key of the blocks at all, so the model is unloaded first.)
    server.free()
    for settings in (STREAMED, {"resident_blocks": 2, "prefetch": 1}):
        message = server.run_expect_error(block_compile(wan(1.0, settings), "blocks_by_object_patch"))
        message = message["exception_message"]
        assert "ComfyUI applies no weight patch (LoRA) under a module an object patch compiled" \
            in message, message
        assert "one key per block" in message, message


def test_whole_model_compiles_are_refused_over_streamed_blocks_and_kept_whole_when_resident(server):
    full, ref = run(server, core_compile(wan(1.0)))
    streamed = wan(1.0, STREAMED)
    for wf in (core_compile(streamed, before_offload=True), core_compile(streamed),
               block_compile(wan(None, STREAMED), "model_by_object_patch")):
        message = server.run_expect_error(wf)["exception_message"]
        assert "it compiles diffusion_model, which holds streamed blocks" in message, message
        assert "2 of its 2 blocks are streamed" in message and "resident_blocks = 2" in message
        assert "Compile the blocks one by one" in message, message
    # Every block resident: nothing moves, and core's compile keeps its graph (nothing compiles).
    resident = core_compile(wan(1.0, {"resident_blocks": 2, "prefetch": 1}), True)
    sha, report = run(server, resident)
    assert sha == full
    assert_graphs_reused(report)
    sha, again = run(server, resident)
    assert sha == full
    assert_graphs_reused(again, report["total"])
    assert run(server, core_compile(wan(1.0)))[0] == full


def test_compiled_streaming_after_an_interrupt_and_from_disk(server):
    full, _ = run(server, block_compile(wan(1.0)))
    streamed = block_compile(wan(1.0, STREAMED))
    prompt_id, sent = queue_and_interrupt(server.url, streamed,
                                          lambda p: p["max"] == 4 and p["value"] == 1)
    assert sent, "the sampling progress was never reported"
    entry = server.wait(prompt_id, timeout=900)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    sha, report = run(server, streamed)
    assert sha == full
    assert_graphs_reused(report)

    # Six blocks of the 2-block Wan's shape (its graphs serve them): five streamed through two
    # slots, so a block is in another slot from one pass to the next; then from disk, through a
    # host cache that holds three.
    settings = {"resident_blocks": 1, "prefetch": 1}
    reference, _ = run(server, block_compile(wan(1.0, six=True)))
    sha, report = run(server, block_compile(wan(1.0, settings, six=True)))
    assert sha == reference
    assert_graphs_reused(report)
    state = server.get("/offload/layerwise")["models"][-1]
    unit = max(state["units"][i]["bytes"] for i in state["streamed_indices"])
    disk = block_compile(wan(1.0, dict(settings, host_cache_gb=3 * (-(-unit // 4096) * 4096) / 2**30),
                             six=True))
    sha, disk_report = run(server, disk)
    state = server.get("/offload/layerwise")["models"][-1]
    assert state["disk"]["active"] and state["telemetry"]["copies"] > 0, state["disk"]
    assert sha == reference
    assert_graphs_reused(disk_report, report["total"])


@pytest.mark.parametrize("setup,words", [
    ({"backend": "cudagraphs"}, ("backend 'cudagraphs' captures CUDA graphs", "Choose backend 'inductor'")),
    ({"mode": "reduce-overhead"}, ("mode 'reduce-overhead' captures CUDA graphs", "Choose backend 'inductor'")),
    ({"mode": "reduce-overhead", "how": "blocks_by_object_patch"},
     ("triton.cudagraphs (modes 'reduce-overhead' and 'max-autotune') captures CUDA graphs",)),
    ({"mode": "max-autotune-no-cudagraphs"}, ("have not been tested with streamed blocks",
                                              "Choose backend 'inductor' with mode 'default'")),
    ({"backend": "eager"}, ("backend 'eager' has not been tested", "Choose backend 'inductor'")),
    ({"dynamic": "true"}, ("dynamic=True has not been tested", "Compile with dynamic off")),
    ({"granularity": "phase"}, ("granularity 'phase' splits", "Use granularity 'block'")),
])
def test_compile_setups_streamed_blocks_cannot_keep_are_refused_before_anything_moves(server, setup, words):
    wf = block_compile(wan(None, dict(STREAMED, granularity=setup.get("granularity", "block"))),
                       setup.get("how", PER_BLOCK), setup.get("backend", "inductor"),
                       setup.get("mode", "default"), dynamic=setup.get("dynamic", "auto"))
    plain = latent_sha(server.run(wan(None)))
    attached = server.log_text().count("attached ")
    message = server.run_expect_error(wf)["exception_message"]
    assert "Apply Layerwise Offload: WanModel is compiled with torch.compile" in message, message
    assert "2 of its 2 blocks are streamed" in message and "resident_blocks = 2" in message, message
    for word in words:
        assert word in message, message
    # Refused before anything moved: the engine attached nothing, and the next prompt is core's.
    assert server.log_text().count("attached ") == attached
    assert not any(m["active"] for m in server.get("/offload/layerwise")["models"])
    assert latent_sha(server.run(wan(None))) == plain

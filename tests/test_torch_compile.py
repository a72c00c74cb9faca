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
import re

import pytest

import tiny_models
from comfy_server import ComfyServer
from workflows import latent_sha, sample_workflow
from ws_interrupt import queue_and_interrupt

STREAMED = {"resident_blocks": 0, "prefetch": 1}
WAN6 = "compile_wan6.safetensors"
WAN6_LORA = "compile_wan6_lora.safetensors"
# A Wan whose blocks have a shape of their own (a wider FFN): no other test compiles its graphs.
WIDE = "compile_wan_wide.safetensors"
WIDE_LORA = "compile_wan_wide_lora.safetensors"
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
    if not (models / "diffusion_models" / WIDE).exists():
        tiny_models.write_tiny_wan21(models / "diffusion_models" / WIDE, ffn_dim=384, seed=65)
    if not (models / "loras" / WIDE_LORA).exists():
        tiny_models.write_tiny_wan_lora(models / "loras" / WIDE_LORA, ffn_dim=384, seed=67)
    base = tmp_path_factory.mktemp("compile_base")
    (base / "models").symlink_to(models, target_is_directory=True)
    # Dynamo logs each recompile with the guards that failed (recompile_reasons reads them).
    comfy = ComfyServer(base, extra_args=("--use-pytorch-cross-attention",),
                        env={"TORCH_LOGS": "recompiles"}).start()
    yield comfy
    comfy.stop()


def wan(lora: float | None = 1.0, layerwise: dict | None = None, six: bool = False,
        wide: bool = False) -> dict:
    wf = sample_workflow("wan21", lora_strength=lora, layerwise=layerwise)
    for asked, model, adapter in ((six, WAN6, WAN6_LORA), (wide, WIDE, WIDE_LORA)):
        if asked:
            wf["load"]["inputs"]["unet_name"] = model
            if lora is not None:
                wf["lora"]["inputs"]["lora_name"] = adapter
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
    prompt of the same setup) not even the first. (The first pass of a prompt may compile what
    no earlier prompt of its setup did.)"""
    passes = report["passes"]
    assert len(passes) >= 4 and all(p == passes[0] for p in passes), passes
    if since is not None:
        assert passes[0] == since, (since, passes)


def recompile_reasons(comfy, since: int = 0) -> list[str]:
    """The guard failures dynamo logged for each recompile after the first ``since`` characters
    of the server's log."""
    reasons, taking = [], False
    for line in comfy.log_text()[since:].splitlines():
        text = line.split("[__recompiles]", 1)[-1].strip()
        if "triggered by the following guard failure(s)" in line:
            taking = True
        elif taking and "[__recompiles]" in line and re.match(r"- \d+/\d+: ", text):
            reasons.append(text)
        else:
            taking = False
    return reasons


def engine_breaks_only(before: dict, after: dict) -> None:
    """The graph breaks that appeared between two reports are all the engine's hooks."""
    added = set(after["break_reasons"]) - set(before["break_reasons"])
    assert all(any(word in reason for word in ENGINE_BREAKS) for reason in added), added


def test_per_block_compile_streams_bit_identical_and_reuses_its_graphs(server):
    full, ref = run(server, block_compile(wan(1.0)))
    half, core = run(server, block_compile(wan(0.5)))
    plain, _ = run(server, wan(1.0))
    assert len({full, half, plain}) == 3, "the LoRA strength and compile must change the result"
    assert ref["block_graphs"]["WanAttentionBlock"] >= 1

    mark = len(server.log_text())
    sha, report = run(server, block_compile(wan(1.0, STREAMED)))
    assert sha == full
    # The streamed blocks ran compiled, on core's graphs: not one graph more, no recompile.
    assert report["block_graphs"]["WanAttentionBlock"] >= 1
    assert_graphs_reused(report)
    assert report["total"]["graphs"] == core["total"]["graphs"], (core, report)
    assert recompile_reasons(server, mark) == []
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
        assert message.startswith("TieredTestCompileBlocks (node compile): ComfyUI applies no "
                                  "weight patch (LoRA) under a module an object patch compiled"), message
        assert "TorchCompileModelAdvanced with compile_transformer_blocks_only on" in message, message


def test_whole_model_compiles_are_refused_over_streamed_blocks_and_kept_whole_when_resident(server):
    full, ref = run(server, core_compile(wan(1.0)))
    one_resident = wan(1.0, {"resident_blocks": 1, "prefetch": 1})  # queued: its block count decides
    for wf, compiler in ((core_compile(one_resident, before_offload=True), "TorchCompileModel (node compile)"),
                         (core_compile(one_resident), "TorchCompileModel (node compile)"),
                         (block_compile(wan(None, {"resident_blocks": 1, "prefetch": 1}),
                                        "model_by_object_patch"), "TieredTestCompileBlocks (node compile)")):
        message = server.run_expect_error(wf)["exception_message"]
        assert message.startswith(f"Apply Layerwise Offload (node offload): {compiler} compiles "
                                  "WanModel whole, as one graph, and this node streams 1 of "
                                  "WanModel's 2 blocks: streaming splits that graph"), message
        assert "resident_blocks = 2 (every block stays on the GPU" in message, message
        assert f"in place of {compiler}, KJNodes' TorchCompileModelAdvanced" in message, message
        assert ("compile_per_block on here" in message) == (wf["compile"]["class_type"] == "TorchCompileModel")
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
    # Raised on the sampler: the message names first the node to change.
    first = ("Apply Layerwise Offload (node offload)" if "granularity" in setup
             else "TieredTestCompileBlocks (node compile)")
    assert message.startswith(f"{first}: "), message
    assert "streams 2 of WanModel's 2 blocks" in message and "resident_blocks = 2" in message, message
    for word in words:
        assert word in message, message
    # Refused before anything moved: the engine attached nothing, and the next prompt is core's.
    assert server.log_text().count("attached ") == attached
    assert not any(m["active"] for m in server.get("/offload/layerwise")["models"])
    assert latent_sha(server.run(wan(None))) == plain


def test_streamed_blocks_compile_no_graph_of_their_own(server):
    """Streamed blocks look to dynamo's guards as core's do, and so does what the model is
    called with. On a Wan of its own block shape (no other test compiled its graphs), compiled
    per block through core's wrapper with no guard filtered out: the prompt with the node (LoRA,
    blocks streamed) first, then the same prompt without it, which must give the same bits and
    compile no graph. It would, were a LoRA'd block weight left with requires_grad where core's
    load leaves it without (comfy_weights.py); and the node's wrappers are not in the table the
    model is called with (node.py). Then the per-block compile the way KJNodes'
    TorchCompileModelAdvanced registers it streams with the same bits."""
    sha, with_node = run(server, block_compile(wan(1.0, STREAMED, wide=True)))
    assert with_node["block_graphs"]["WanAttentionBlock"] >= 1  # the streamed blocks ran compiled
    assert_graphs_reused(with_node)
    mark = len(server.log_text())
    reference, without = run(server, block_compile(wan(1.0, wide=True)))
    assert reference == sha
    assert without["total"]["graphs"] == with_node["total"]["graphs"], recompile_reasons(server, mark)
    half, again = run(server, block_compile(wan(0.5, STREAMED, wide=True)))
    assert half != reference
    assert again["total"]["graphs"] == with_node["total"]["graphs"], recompile_reasons(server, mark)
    registry = block_compile(wan(1.0, STREAMED, wide=True), "registry_block_keys")
    assert run(server, registry)[0] == reference
    # The model is called with core's wrapper table, without the node's entries: a compiled
    # graph that reads it (SD3's blocks do, with ComfyUI's CPU attention) guards on nothing the
    # node added.
    assert with_node["wrapper_tables"] == without["wrapper_tables"], (with_node, without)


def test_compile_per_block_takes_a_whole_model_compile_over(server):
    """compile_per_block: ComfyUI's TorchCompileModel, before or after the node, then compiles
    each block on its own with its settings, streamed or every block resident alike, and gives
    the bits of the per-block compile without the node."""
    per_block, _ = run(server, block_compile(wan(1.0)))
    for settings in (STREAMED, {"resident_blocks": 2, "prefetch": 1}):
        for before in (False, True):
            wf = core_compile(wan(1.0, dict(settings, compile_per_block=True)), before_offload=before)
            sha, report = run(server, wf)
            assert sha == per_block, (settings, before)
            assert_graphs_reused(report)


def test_a_compile_the_settings_cannot_keep_is_refused_when_queued(server):
    """Where the posted prompt shows both, a compile that the node's settings cannot keep is
    refused when the prompt is queued, on the node to change, with the choices; nothing runs."""
    wf = core_compile(wan(None, STREAMED))
    wf["compile"]["_meta"] = {"title": "Compile the model"}
    details = server.refused(wf, "offload")
    assert details.startswith("model - Apply Layerwise Offload (node offload): Compile the model "
                              "(node compile) compiles the model whole, as one graph, and this "
                              "node streams every block (resident_blocks 0)"), details
    for choice in ("compile_per_block on here", "resident_blocks = the model's block count",
                   "in place of Compile the model (node compile), KJNodes' TorchCompileModelAdvanced"):
        assert choice in details, details
    assert details.count(" - ") == 1, details
    phases = core_compile(wan(None, dict(STREAMED, compile_per_block=True, granularity="phase")))
    details = server.refused(phases, "offload")
    assert details.startswith("model - Apply Layerwise Offload (node offload): TorchCompileModel "
                              "(node compile) compiles the blocks of the model one by one"), details
    assert "granularity 'phase' splits" in details and "Use granularity 'block'" in details, details
    # What the node's settings keep is queued and runs (graphs of the whole-model test above).
    resident = core_compile(wan(1.0, {"resident_blocks": 2, "prefetch": 1}), True)
    assert latent_sha(server.run(resident, timeout=900))

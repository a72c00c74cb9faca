"""Probe of Apply Layerwise Offload's two modes against the ComfyUI tree under test.

Run by the `dynamic_vram_probe` fixture (conftest.py) as `PYTHON dynamic_vram_probe.py OUT_DIR`
with the ComfyUI root as the working directory (the Python and tree the server tests use). Prints
one JSON object.

Models come from ComfyUI's real loader (`comfy.sd.load_diffusion_model`, which registers the
reload factory `cached_patcher_init`); the node and core's clone / delegate / load code are the
real ones. Dynamic models are stand-ins (tests/dynamic_vram_standin.py) because a real
ModelPatcherDynamic needs a GPU; `order_cases` runs them through core's own `load_models_gpu` and
sampler, so a model is laid out by core before the node runs, as a user's would be. The reload
factory is wrapped to count its calls (it still runs): that count is how "no reload" is seen.
"""
from __future__ import annotations

import gc
import importlib
import inspect
import json
import logging
import sys
import types
import weakref
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

OUT_DIR = Path(sys.argv[1])
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI parses the command line when comfy.cli_args loads
sys.path.insert(0, str(Path.cwd()))
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "fixtures"))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.sd  # noqa: E402
import tiny_models  # noqa: E402

LAYERS = 4
SETTINGS = {"resident_blocks": 2, "vram_budget_gb": 12.0, "prefetch": 1, "pin": True}


def import_pack():
    """nodes/ as a package, without running the pack's server wiring."""
    for name, path in (("tiered_offload_probe", REPO), ("tiered_offload_probe.nodes", REPO / "nodes")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    return (importlib.import_module("tiered_offload_probe.nodes.layerwise.node"),
            importlib.import_module("tiered_offload_probe.nodes.core.state"))


def is_dynamic(patcher) -> bool:
    return sys.modules["tiered_offload_probe.nodes.core.models"].is_dynamic(patcher)


def state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class CountingLoader:
    """Core's loader function, counted."""

    def __init__(self, source) -> None:
        self.fn, self.args = source.cached_patcher_init[0], source.cached_patcher_init[1]
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)

    def install(self, patcher) -> None:
        patcher.cached_patcher_init = (self, self.args)


def classic_case(layerwise, state, path: Path) -> dict:
    classic = comfy.sd.load_diffusion_model(str(path))
    settings = layerwise.LayerwiseSettings(**{k: SETTINGS[k] for k in ("resident_blocks", "vram_budget_gb",
                                                                          "prefetch", "pin")})
    got = layerwise._classic_patcher(classic, settings)
    node = layerwise.ApplyLayerwiseOffload
    outs = {mode: node.execute(classic, **SETTINGS, mode=mode)[0] for mode in ("auto", "engine")}
    return {
        "input_dynamic": is_dynamic(classic),
        "is_clone": got is not classic,
        "shares_module": got.model is classic.model,
        "output_dynamic": is_dynamic(got),
        # On a classic model both modes are the engine: no object patch, a session per module.
        "modes_share_module": all(o.model is classic.model for o in outs.values()),
        "modes_have_units_patch": [standin_units(o) is not None for o in outs.values()],
        "engine_session": any(r["module_id"] == id(classic.model.diffusion_model)
                              for r in state.LAYERWISE.report()),
    }


def standin_units(patcher):
    return patcher.object_patches.get("get_dynamic_vram__units")


def engine_sessions(state) -> list[dict]:
    """The engine's own sessions (reports of models core streams in the node's order excluded)."""
    return [r for r in state.LAYERWISE.report()
            if (r.get("dynamic_vram") or {}).get("path") != "core streams"]


def sample(model) -> torch.Tensor:
    """Two steps of core's own sampler (comfy.sample.sample, as KSampler calls it)."""
    import comfy.sample
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 42)
    cond = [[torch.randn(1, 8, 4096, generator=torch.Generator().manual_seed(1)), {}]]
    return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", cond, cond, latent)


def sample_hunyuan(model) -> torch.Tensor:
    """Two steps of core's sampler on the tiny HunyuanVideo (double and single blocks)."""
    import comfy.sample
    spec = tiny_models.MODELS["hunyuan_video"]
    latent = torch.zeros(*spec["latent"]["shape"])
    noise = comfy.sample.prepare_noise(latent, 42)
    g = torch.Generator().manual_seed(1)
    extra = {k: torch.randn(*shape, generator=g) for k, shape in spec["conditioning"]["tensors"].items()}
    cond = [[torch.randn(*spec["conditioning"]["cross_attn"], generator=g),
             dict(extra, **spec["conditioning"]["values"])]]
    return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", cond, cond, latent)


# The stand-in has no link: a copy to its "device" is a memcpy, whose rate a busy host varies
# several-fold, and the order the measurements choose with it. The order cases give the tuner a
# link of 1 GB/s instead (a block's copy then outweighs its compute, as when a large DiT streams
# over PCIe); the real timed copy (device/link.py) is recorded apart.
STANDIN_LINK_BYTES_PER_MS = 1e6


def fixed_link(state, diffusion_model) -> None:
    state.LAYERWISE.cooperations.get(diffusion_model).link_bytes_per_ms = STANDIN_LINK_BYTES_PER_MS


def fresh_hunyuan(path: Path):
    """The tiny HunyuanVideo at ``path`` loaded afresh on the stand-in: the patcher, core's own
    latent for it, its blocks and their sizes."""
    import dynamic_vram_standin as standin
    dyn = standin.runnable(comfy.sd.load_diffusion_model(str(path)))
    core = sample_hunyuan(dyn)
    discovery = importlib.import_module("tiered_offload_probe.offload_core.blocks.discovery")
    blocks = list(discovery.find_blocks(dyn.model.diffusion_model).blocks)
    return dyn, core, blocks, [comfy.model_management.module_size(b) for b in blocks]


def hooks_on(model: torch.nn.Module, blocks) -> int:
    """Forward hooks on the model and its blocks (the timing hooks must all come off)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in [model, *blocks])


def measured_order_case(layerwise, state, path: Path) -> dict:
    """auto with a budget on a model whose blocks differ in size (HunyuanVideo's double and single
    blocks): the first run streams in the budget's order and is timed; the next run is laid out in
    the order the measurements chose; the one after checks it and holds it."""
    import dynamic_vram_standin as standin
    vbar_layout = sys.modules["tiered_offload_probe.nodes.layerwise.vbar_layout"]
    node = layerwise.ApplyLayerwiseOffload
    dyn, core, coop_blocks, sizes = fresh_hunyuan(path)
    diffusion_model = dyn.model.diffusion_model
    # 3 double blocks' room: the budget's rule (spread evenly, prefetch 1) keeps one single block
    settings = dict(SETTINGS, resident_blocks=-1, vram_budget_gb=3 * max(sizes) / 2**30)
    runs = []
    for _ in range(3):
        patcher = node.execute(dyn, **settings)[0]
        fixed_link(state, diffusion_model)
        latent = sample_hunyuan(patcher)
        coop = state.LAYERWISE.cooperations.get(diffusion_model)
        r = coop.report()
        layout = vbar_layout.read(dyn.model, standin.CPU0, coop_blocks)
        runs.append({"same_as_core": torch.equal(latent, core), "resident": r["resident_indices"],
                     "in_force": bool(layout and layout.in_order(r["resident_indices"], r["streamed_indices"])),
                     "tuning": r["tuning"], "auto_settings": r["auto_settings"],
                     "relayouts": r["dynamic_vram"]["relayouts"],
                     "hooks_after": hooks_on(diffusion_model, coop_blocks)})
    # An interrupt in the middle of a timed run (core raises it from inside the model, as here):
    # the timing hooks come off with the run, and the next run is core's result, bit for bit.
    fresh, fresh_core, fresh_blocks, _ = fresh_hunyuan(path)
    calls = []

    def interrupt(module, args):
        calls.append(1)
        if len(calls) == 2:  # block 2 of the second call
            raise comfy.model_management.InterruptProcessingException()

    handle = fresh_blocks[2].register_forward_pre_hook(interrupt)
    try:
        sample_hunyuan(node.execute(fresh, **settings)[0])
        interrupted = False
    except comfy.model_management.InterruptProcessingException:
        interrupted = True
    finally:
        handle.remove()
    hooks_left = hooks_on(fresh.model.diffusion_model, fresh_blocks)
    after = [torch.equal(sample_hunyuan(node.execute(fresh, **settings)[0]), fresh_core) for _ in range(2)]
    link = importlib.import_module("tiered_offload_probe.offload_core.device.link")
    return {"block_bytes": sizes, "budget_bytes": int(settings["vram_budget_gb"] * 2**30), "runs": runs,
            "report": coop.report(), "timed_copy_bytes_per_ms": link.copy_rate(standin.CPU0),
            "interrupted": {"raised": interrupted, "hooks_left": hooks_left, "next_runs_same_as_core": after}}


def fixed_count_case(layerwise, state, path: Path) -> dict:
    """A resident count fixed on the node, with the budget of measured_order_case: the order is
    the user's in every run; the first run is timed, and the report says what auto would keep."""
    node = layerwise.ApplyLayerwiseOffload
    dyn, core, blocks, sizes = fresh_hunyuan(path)
    diffusion_model = dyn.model.diffusion_model
    settings = dict(SETTINGS, resident_blocks=1, vram_budget_gb=3 * max(sizes) / 2**30)
    runs = []
    for _ in range(2):
        patcher = node.execute(dyn, **settings)[0]
        fixed_link(state, diffusion_model)
        latent = sample_hunyuan(patcher)
        r = state.LAYERWISE.cooperations.get(diffusion_model).report()
        runs.append({"same_as_core": torch.equal(latent, core), "resident": r["resident_indices"],
                     "tuning": r["tuning"], "auto_settings": r["auto_settings"],
                     "relayouts": r["dynamic_vram"]["relayouts"],
                     "hooks_after": hooks_on(diffusion_model, blocks)})
    return {"block_bytes": sizes, "runs": runs,
            "report": state.LAYERWISE.cooperations.get(diffusion_model).report()}


def block_hooks(model) -> int:
    """Forward hooks on the model's block modules (the engine's way in; auto must add none)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
               for b in model.model.diffusion_model.blocks for m in b.modules())


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def layout_of(vbar_layout, dyn) -> dict:
    import dynamic_vram_standin as standin
    layout = vbar_layout.read(dyn.model, standin.CPU0, list(dyn.model.diffusion_model.blocks))
    return {"blocks": layout.block_spans(), "rest": layout.rest_span()} if layout else None


def order_cases(layerwise, state, path: Path) -> dict:
    """auto on models core has laid out already: sampled first without the node, then with it;
    with changed settings; with the default settings; and where the layout cannot be handed back.
    Every run is core's own sampler on the stand-in, so each latent can be compared with core's."""
    import dynamic_vram_standin as standin
    vbar_layout = sys.modules["tiered_offload_probe.nodes.layerwise.vbar_layout"]
    logs = LogLines()
    logging.getLogger("tiered_offload_probe").addHandler(logs)
    logging.getLogger("tiered_offload_probe").setLevel(logging.INFO)
    node = layerwise.ApplyLayerwiseOffload
    out: dict = {}

    def report_of(dyn) -> dict:
        cooperations = state.LAYERWISE.cooperations.values()
        return next(r for r in (c.report() for c in cooperations)
                    if r["module_id"] == id(dyn.model.diffusion_model))

    dyn = standin.runnable(comfy.sd.load_diffusion_model(str(path)))
    core = sample(dyn)  # core alone lays the model out in its own order
    first_vbar = dyn.model.dynamic_vbars[standin.CPU0]
    out["core_alone"] = layout_of(vbar_layout, dyn)
    steps = []
    block = comfy.model_management.module_size(dyn.model.diffusion_model.blocks[0])
    # prefetch 1: one resident block plus two streamed-block slots fit 3.5 blocks, two do not.
    one_block_budget = 3.5 * block / 2**30
    for name, settings in (("node after core", SETTINGS),
                           ("resident_blocks changed", dict(SETTINGS, resident_blocks=1)),
                           ("same settings again", dict(SETTINGS, resident_blocks=1)),
                           ("default settings", dict(SETTINGS, resident_blocks=-1, vram_budget_gb=0.0)),
                           ("a budget for one block", dict(SETTINGS, resident_blocks=-1,
                                                          vram_budget_gb=one_block_budget))):
        patcher = node.execute(dyn, **settings)[0]
        hooks_before = block_hooks(patcher)
        latent = sample(patcher)
        r = report_of(dyn)
        if name == "default settings":
            out["report_in_force"] = r  # what /offload/layerwise and the panel get
        steps.append({"step": name, "same_as_core": torch.equal(latent, core),
                      "layout": layout_of(vbar_layout, dyn), "resident": r["resident_indices"],
                      "streamed": r["streamed_indices"], "dynamic_vram": r["dynamic_vram"],
                      "budget_bytes": r["budget_bytes"], "block_hooks": [hooks_before, block_hooks(patcher)]})
    out["steps"] = steps
    out["one_block_budget_bytes"] = int(one_block_budget * 2**30)
    out["first_vbar_unpinned"] = first_vbar.unpinned
    out["first_vbar_slices"] = sum(1 for m in dyn.model.modules() if hasattr(m, "_v"))
    first_ref = weakref.ref(first_vbar)
    del first_vbar
    gc.collect()
    out["first_vbar_freed"] = first_ref() is None
    out["engine_sessions_for_model"] = sum(r["module_id"] == id(dyn.model.diffusion_model)
                                           for r in engine_sessions(state))

    # A layout that cannot be handed back now: core holds a CUDA graph over a block (it drops
    # them after each node; one left over stands for any state in which core uses the slices).
    held = standin.runnable(comfy.sd.load_diffusion_model(str(path)))
    held_core = sample(held)
    before = layout_of(vbar_layout, held)
    held.model.diffusion_model.blocks[0]._comfy_graph = {"graph": None, "signature": None}
    logs.lines.clear()
    latent = sample(node.execute(held, **SETTINGS)[0])
    r = report_of(held)
    out["held"] = {"same_as_core": torch.equal(latent, held_core),
                   "layout_unchanged": layout_of(vbar_layout, held) == before,
                   "dynamic_vram": r["dynamic_vram"],
                   "warnings": [line for line in logs.lines if "order already fixed" in line],
                   "report": r}
    return out


def load_order(dyn) -> dict:
    """Run core's ModelPatcherDynamic.load on `dyn` and read the VBAR addresses it assigned."""
    import dynamic_vram_standin as standin
    device = torch.device("cpu", 0)  # not "the CPU" to core's VBAR check, the same memory
    dyn.load_device = device
    standin.prepare_dynamic_load(dyn, device)
    dyn.patch_model(load_weights=False)  # applies object patches, as partially_load does
    try:
        had_units = hasattr(dyn.model, "get_dynamic_vram__units")
        dyn.load(device)
    finally:
        dyn.unpatch_model(unpatch_weights=False)
    restored = not hasattr(dyn.model, "get_dynamic_vram__units")
    blocks = list(dyn.model.diffusion_model.blocks)
    spans = {}
    for i, block in enumerate(blocks):
        addrs = [(m._v[1], m._v[1] + m._v[2]) for m in block.modules() if hasattr(m, "_v")]
        spans[i] = (min(a for a, _ in addrs), max(b for _, b in addrs))
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    others = [m._v[1] for m in dyn.model.modules() if hasattr(m, "_v") and id(m) not in in_blocks]
    return {"had_units_during_load": had_units, "patch_restored": restored,
            "block_spans": spans, "other_range": (min(others), max(others)),
            "unit_roots_marked": [hasattr(b, "_v_block") for b in blocks]}


def dynamic_cases(layerwise, state, path: Path) -> dict:
    import dynamic_vram_standin as standin
    report: dict = {}
    node = layerwise.ApplyLayerwiseOffload
    source = comfy.sd.load_diffusion_model(str(path))
    loader = CountingLoader(source)
    dyn = standin.dynamic_from(source)
    loader.install(dyn)

    # auto: core streams; the node only orders the VBAR. No copy, no reload.
    auto = node.execute(dyn, **SETTINGS, mode="auto")[0]
    units = standin_units(auto)
    resident, streamed = units() if units is not None else ([], [])
    blocks = list(dyn.model.diffusion_model.blocks)
    report["auto"] = {
        "output_dynamic": is_dynamic(auto),
        "shares_module": auto.model is dyn.model,
        "loader_calls": loader.calls,
        "resident": [blocks.index(b) for b in resident],
        "streamed": [blocks.index(b) for b in streamed],
        "engine_session": any(r["module_id"] == id(dyn.model.diffusion_model)
                              for r in engine_sessions(state)),
        "block_hooks": block_hooks(auto),
    }

    # Core's own load, with and without the node: which blocks get the low (kept) addresses.
    for name, make in (("order_with_node", lambda d: node.execute(d, **SETTINGS, mode="auto")[0]),
                       ("order_core_alone", lambda d: d)):
        spent = standin.dynamic_from(comfy.sd.load_diffusion_model(str(path)))
        report[name] = load_order(make(spent))

    # engine: a classic twin over the model's own host tensors, made once per model.
    first = node.execute(dyn, **SETTINGS, mode="engine")[0]
    dyn_state = dyn.model.state_dict()
    block_keys = [k for k in dyn_state if k.startswith("diffusion_model.blocks.")]
    twin_state = first.model.state_dict()
    calls_first = loader.calls
    lora = standin.with_lora(dyn, 0.5)
    after_lora = node.execute(lora, **SETTINGS, mode="engine")[0]
    lora2 = standin.with_lora(dyn, 0.8)
    other_settings = node.execute(lora2, **dict(SETTINGS, resident_blocks=1), mode="engine")[0]
    entry = state.DYNAMIC_DELEGATES.get(dyn.model)
    session = next((r for r in engine_sessions(state)
                    if r["module_id"] == id(first.model.diffusion_model)), None)
    report["engine"] = {
        "output_type": type(first).__name__,
        "output_dynamic": is_dynamic(first),
        "new_module": first.model is not dyn.model,
        "same_weights": state_equal(first.model, dyn.model),
        "blocks_shared": all(twin_state[k].untyped_storage().data_ptr()
                             == dyn_state[k].untyped_storage().data_ptr() for k in block_keys),
        "rest_shared": [k for k in dyn_state if k not in block_keys and dyn_state[k].numel()
                        and twin_state[k].untyped_storage().data_ptr()
                        == dyn_state[k].untyped_storage().data_ptr()],
        "loader_calls_first": calls_first,
        "loader_calls_after_lora_and_settings": loader.calls,
        "lora_reuses_copy": after_lora.model is first.model and other_settings.model is first.model,
        "lora_patches_kept": after_lora.patches.keys() == lora.patches.keys()
                             and after_lora.patches_uuid == lora.patches_uuid
                             and after_lora.patches_uuid != first.patches_uuid,
        "uses": entry.uses if entry else None,
        "report": session["dynamic_vram"] if session else None,
        "model_size": dyn.model_size(),
    }

    # Refusals come before any copy.
    refused = {}
    fresh = standin.dynamic_from(comfy.sd.load_diffusion_model(str(path)))
    fresh_loader = CountingLoader(fresh)
    fresh_loader.install(fresh)
    bad = fresh.clone()
    bad.add_object_patch("diffusion_model", torch.nn.Linear(2, 2))
    cases = {"budget": (fresh, dict(SETTINGS, resident_blocks=-1, vram_budget_gb=1e-6)),
             "unsupported_model": (bad, SETTINGS)}
    for name, (model, settings) in cases.items():
        try:
            node.execute(model, **settings, mode="engine")
            refused[name] = "accepted"
        except Exception as e:  # noqa: BLE001 - the probe reports what the node raised
            refused[name] = type(e).__name__
    refused["loader_calls"] = fresh_loader.calls
    refused["no_copy_kept"] = state.DYNAMIC_DELEGATES.get(fresh.model) is None
    # A model whose loader registered no way to rebuild it (core's loaders all do): the twin
    # needs none.
    no_loader = standin.dynamic_from(comfy.sd.load_diffusion_model(str(path)), with_loader=False)
    twin = node.execute(no_loader, **SETTINGS, mode="engine")[0]
    refused["no_loader_engine"] = (state.DYNAMIC_DELEGATES.get(no_loader.model).path,
                                   twin.model is not no_loader.model)
    refused["no_loader_auto_dynamic"] = is_dynamic(node.execute(no_loader, **SETTINGS)[0])
    # No twin (a model without the config core builds it from): a reload, counted, or where the
    # loader cannot reload either, a refusal that names auto.
    configless = standin.dynamic_from(comfy.sd.load_diffusion_model(str(path)))
    configless_loader = CountingLoader(configless)
    configless_loader.install(configless)
    configless.model.model_config = None
    node.execute(configless, **SETTINGS, mode="engine")
    fallback = state.DYNAMIC_DELEGATES.get(configless.model)
    refused["no_twin"] = {"path": fallback.path, "loader_calls": configless_loader.calls,
                          "cost": fallback.cost()}
    bare = standin.dynamic_from(comfy.sd.load_diffusion_model(str(path)), with_loader=False)
    bare.model.model_config = None
    try:
        node.execute(bare, **SETTINGS, mode="engine")
        refused["no_twin_no_loader"] = "accepted"
    except ValueError as e:
        refused["no_twin_no_loader"] = str(e)
    del twin, configless, fallback, bare
    try:
        node.execute(dyn, **SETTINGS, mode="fastest")
        refused["bad_mode"] = "accepted"
    except ValueError as e:
        refused["bad_mode"] = str(e)
    report["refused"] = refused

    # The copy is freed with the model it was made from.
    copy_ref = weakref.ref(first.model)
    dyn_ref = weakref.ref(dyn.model)
    copy_module_id = id(first.model.diffusion_model)
    del auto, first, after_lora, other_settings, lora, lora2, dyn, entry, session, units
    del resident, streamed, blocks, source, no_loader
    gc.collect()
    report["released"] = {
        "model_freed": dyn_ref() is None,
        "copy_freed": copy_ref() is None,
        "copies_left": len(state.DYNAMIC_DELEGATES.values()),
        "engine_session_left": any(r["module_id"] == copy_module_id for r in engine_sessions(state)),
    }
    return report


def main() -> None:
    path = OUT_DIR / "probe_wan21.safetensors"
    tiny_models.write_tiny_wan21(path, layers=LAYERS, seed=11)
    layerwise, state = import_pack()
    MP = comfy.model_patcher.ModelPatcher
    report: dict = {"clone_params": list(inspect.signature(MP.clone).parameters)[1:],
                    "classic": classic_case(layerwise, state, path)}
    MPD = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if MPD is None:
        report["dynamic"] = None
    else:
        report["dynamic"] = dynamic_cases(layerwise, state, path)
        report["dynamic"]["orders"] = order_cases(layerwise, state, path)
        hunyuan = OUT_DIR / "probe_hunyuan_video.safetensors"
        tiny_models.write_tiny_hunyuan_video(hunyuan, **dict(tiny_models.MODELS["hunyuan_video"]["writer_kwargs"],
                                                             single_blocks=4, hidden=512))
        report["dynamic"]["measured_order"] = measured_order_case(layerwise, state, hunyuan)
        report["dynamic"]["fixed_count"] = fixed_count_case(layerwise, state, hunyuan)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

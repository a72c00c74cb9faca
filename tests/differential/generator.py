"""Seeded generator of prompt sequences for the differential test.

A sequence is a list of steps, each a JSON-ready dict:
- {"op": "prompt", "p": workflow, "q": twin, "interrupt": None|"packing"|"sampling", ...}
- {"op": "free"}: `POST /free` on both servers;
- {"op": "tier_action", "action": "park"|"evict"|"load", "name": file}: a REST move on P only
  (Q has no tier manager; the result must not depend on where P keeps a model);
- {"op": "tier_budgets", "body": {...}}: `POST /offload/budgets` on P, to lift a tiny RAM budget
  a prompt set two prompts earlier.

Prompts are built from "chains": a loader and an ordered list of model operations (LoRA or LoHa
loaders, Apply Layerwise Offload, VRAM Tier Manager, Model-Level Swap, a test block-replace
patch, torch.compile of the whole model or of each block). Compile is drawn from a random stream
of its own, so a campaign without it (`compile_share` 0) draws every other choice as before; so
is a hook LoRA on the positive (`hook_share`), which core applies while it samples, and one of
core's own nodes that change the model (`core_node_share`: every MODEL → MODEL node the server
lists, core_nodes.py). Shapes: one sampler, two branches from one loader, or two samplers with two
models.
Consecutive prompts often reuse the previous chain's model and loader with changed operations,
because state carried between prompts is where the pack can go wrong. Two scenarios are planted
as fixed runs of prompts: an interrupt while a LoRA'd 16-block Wan is packed (issue 10's case
D), and a swapped Tiered model dropped by a tiny RAM budget (case C).

Every prompt samples with fresh test conditioning (always re-executed by ComfyUI) and encodes a
text that is unique to its step, so no compared output can come from ComfyUI's output cache.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from . import core_nodes
from .catalogue import GIB, Catalogue, Model
from .twin import strip
from .workflow import Graph, out

STRENGTHS = (1.0, 1.0, 0.5, 0.0, -0.7, 1.6)
WEIGHT_DTYPES = ("fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fn_fast")
BUDGETS_GB = (0.0, 0.0001, 0.01, 0.25, 1.0, 12.0)
SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m", "uni_pc")
SCHEDULERS = ("simple", "normal", "karras")
WORDS = ("lighthouse", "dusk", "harbour", "fox", "lantern", "glacier", "market", "violin",
         "orchard", "comet", "tram", "ember")
SHARED_MIB = 64
# torch.compile as ComfyUI's TorchCompileModel (the whole model) or as per-block compile nodes
# (core's compile wrapper, one key per block); inductor, its default mode.
COMPILES = ("whole", "blocks")
COMPILED_FILE_DTYPES = ("fp32", "bf16", "fp16")
# Core's hook LoRAs (CreateHookLoraModelOnly + ConditioningSetProperties on the positive): core
# patches the hooked weights in place while it samples, which every node of the pack must take.
# Drawn from a stream of their own, so the other draws of a seed stay as they were.
HOOK_SHARE = 0.3
HOOK_STRENGTHS = (1.0, 0.6, -0.5, 1.4)
# Core's own nodes that change the model (core_nodes.py, read from the server), one in a chain of
# this share, before or after the pack's nodes; from a stream of their own too.
CORE_NODE_SHARE = 0.4


@dataclass
class Chain:
    model: Model
    loader: str
    weight_dtype: str = "default"
    ops: list[dict[str, Any]] = field(default_factory=list)
    # A torch.compile among the ops: {"how", "at": where, as a share of the final op list}. Kept
    # apart so that no draw of the main stream depends on it.
    compile: dict[str, Any] | None = None
    # One of core's MODEL -> MODEL nodes, kept apart the same way (placed by its own "at").
    core_node: dict[str, Any] | None = None

    def adapters(self) -> list[dict[str, Any]]:
        return [op for op in self.ops if op["op"] == "lora"]


class Generator:
    def __init__(self, seed: int, catalogue: Catalogue, *, interrupts: bool = True,
                 rest_actions: bool = True, compile_share: float = 0.0, hook_share: float = HOOK_SHARE,
                 core: core_nodes.CoreNodes | None = None, core_node_share: float = CORE_NODE_SHARE) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.compile_rng = random.Random(f"compile-{seed}")
        self.compile_share = compile_share
        self.hook_rng = random.Random(f"hook-{seed}")
        self.hook_share = hook_share
        self.core_rng = random.Random(f"core-{seed}")
        self.core = core
        self.core_node_share = core_node_share if core is not None and core.drawable else 0.0
        self.cat = catalogue
        self.models = [m for m in catalogue.usable() if not m.big]
        self.big = [m for m in catalogue.usable() if m.big]
        self.interrupts = interrupts
        self.rest_actions = rest_actions
        self.previous: Chain | None = None
        self.pending: list[dict[str, Any]] = []  # the next prompts of a scenario: _finish arguments
        self.tiered_names: list[str] = []
        self.capped_budget = False  # a RAM budget is set: a Tiered load may be refused
        self.lift_after: int | None = None  # prompts until a tiny RAM budget is lifted
        self.index = 0

    # -- sequence -------------------------------------------------------------------------------
    def sequence(self, prompts: int) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = []
        made = 0
        while made < prompts:
            r = self.rng.random()
            if self.pending:  # a scenario's prompts follow each other directly
                r = 1.0
            if steps and r < 0.07:
                steps.append({"op": "free", "tags": ["free"]})
            elif steps and r < 0.11 and self.rest_actions and self.tiered_names:
                steps.append({"op": "tier_action", "tags": ["rest_action"],
                              "action": self.rng.choice(("park", "evict", "load")),
                              "name": self.rng.choice(self.tiered_names)})
            steps.append(self.prompt())
            made += 1
            if self.lift_after is not None:
                self.lift_after -= 1
                if self.lift_after <= 0 and not self.pending:
                    # The budget is process-wide on P and stays: lift it over REST (a Tiered
                    # loader in a prompt would be refused before its tier manager node ran).
                    steps.append({"op": "tier_budgets", "body": {"ram_budget_gb": None},
                                  "tags": ["rest_budgets"]})
                    self.lift_after, self.capped_budget = None, False
        return steps

    def prompt(self) -> dict[str, Any]:
        self.index += 1
        if self.pending:
            return self._finish("single", **self.pending.pop(0))
        interrupt = None
        if self.interrupts and self.rng.random() < 0.06:
            if self.big and self.rng.random() < 0.6:
                return self._packing_interrupt()
            interrupt = "sampling"
        elif self.rng.random() < 0.03:
            return self._swap_then_drop()
        shape, chains = self._random_shape()
        return self._finish(shape, chains, interrupt=interrupt)

    def _random_shape(self) -> tuple[str, list[Chain]]:
        r = self.rng.random()
        if r < 0.18:  # one loader feeding a LoRA branch and an offload (or swap) branch
            first = self._chain()
            if not first.adapters() and first.model.adapters:
                first.ops.insert(0, {"op": "lora", "adapter": self.rng.choice(first.model.adapters).filename,
                                     "strength": self.rng.choice(STRENGTHS)})
            second = self._chain(first.model, loader=first.loader, weight_dtype=first.weight_dtype)
            if not any(op["op"] == "offload" for op in second.ops) and self.rng.random() < 0.6:
                second.ops.insert(self.rng.randint(0, len(second.ops)), self._offload_op(second.model))
            return "two_branch", [first, second]
        if r < 0.32:
            first = self._chain()
            partners = [m for m in self.models
                        if m.cond_kind == first.model.cond_kind and m.latent == first.model.latent]
            return "two_stage", [first, self._chain(self.rng.choice(partners))]
        return "single", [self._chain()]

    def _packing_interrupt(self) -> dict[str, Any]:
        """Issue 10's case D: a LoRA'd 16-block Wan runs plainly (core merges the LoRA), then
        with Apply Layerwise Offload, interrupted while the engine packs it; then plainly again
        (core must not believe its merge is still there), and once more offloaded."""
        model = self.rng.choice(self.big)
        loader = self.rng.choice(("UNETLoader", "TieredUNETLoader"))
        lora = {"op": "lora", "adapter": model.adapters[0].filename, "strength": 1.0}
        offload = {"op": "offload", "resident_blocks": self.rng.choice((0, 1, 2)), "vram_budget_gb": 12.0,
                   "prefetch": self.rng.choice((1, 2)), "pin": True}
        plain = Chain(model, loader, "default", [dict(lora)])
        offloaded = Chain(model, loader, "default", [dict(lora), offload])
        common = {"steps": 3, "extras": False, "scenario": "packing_interrupt"}
        self.pending = [{"chains": [offloaded], "interrupt": "packing", **common},
                        {"chains": [plain], "interrupt": None, **common},
                        {"chains": [offloaded], "interrupt": None, **common}]
        return self._finish("single", [plain], interrupt=None, **common)

    def _swap_then_drop(self) -> dict[str, Any]:
        """Issue 10's case C: a Tiered model under Model-Level Swap (with a LoRA, which issue
        10's case B says its master may keep), then another Tiered model with a RAM budget so
        small that the idle first one is dropped to disk, then the first one again, plainly
        (refused under that budget as documented, or loaded); the budget is lifted after."""
        rng = self.rng
        a, b = rng.sample([m for m in self.models if m.folder == "diffusion_models" and not m.mixed], 2)
        tiny = {"op": "tier", "ram_budget_gb": 0.001, "ram_reserve_gb": 0.0, "vram_reserve_gb": 0.0,
                "disk_tier": True, "keep_in_ram": False, "priority": 0}
        lora = [{"op": "lora", "adapter": rng.choice(a.adapters).filename, "strength": 1.0}]
        common = {"interrupt": None, "steps": 2, "extras": False, "scenario": "swap_then_drop"}
        self.pending = [{"chains": [Chain(b, "TieredUNETLoader", "default", [tiny])], **common},
                        {"chains": [Chain(a, "TieredUNETLoader", "default", [])], **common}]
        return self._finish("single", [Chain(a, "TieredUNETLoader", "default", lora)], swap=True, **common)

    # -- chains ---------------------------------------------------------------------------------
    def _chain(self, model: Model | None = None, *, loader: str | None = None,
               weight_dtype: str | None = None) -> Chain:
        rng = self.rng
        prev = self.previous
        if model is None and prev is not None and not prev.model.big and rng.random() < 0.5:
            model, loader, weight_dtype = prev.model, prev.loader, prev.weight_dtype
        if model is None:  # family first, so one with many files (Wan) does not crowd the rest out
            family = rng.choice(sorted({m.family for m in self.models}))
            model = rng.choice([m for m in self.models if m.family == family])
        if loader is None:
            core = "CheckpointLoaderSimple" if model.folder == "checkpoints" else "UNETLoader"
            tiered = "TieredCheckpointLoader" if model.folder == "checkpoints" else "TieredUNETLoader"
            loader = tiered if rng.random() < 0.4 else core
        if weight_dtype is None:
            weight_dtype = "default"
            if model.folder == "diffusion_models" and not model.mixed and rng.random() < 0.25:
                weight_dtype = rng.choice(WEIGHT_DTYPES)
        ops: list[dict[str, Any]] = []
        adapters = list(model.adapters)
        rng.shuffle(adapters)
        for adapter in adapters[:rng.choice((0, 0, 1, 1, 1, 2))]:
            ops.append({"op": "lora", "adapter": adapter.filename, "strength": rng.choice(STRENGTHS)})
        if rng.random() < 0.5:
            ops.insert(rng.randint(0, len(ops)), self._offload_op(model))
        if model.family == "wan" and rng.random() < 0.08:
            ops.insert(rng.randint(0, len(ops)), {"op": "block_replace",
                                                  "scale": rng.choice((1.001, 0.999))})
        tiered_loader = loader.startswith("Tiered")
        if rng.random() < (0.3 if tiered_loader else 0.02):
            ops.insert(rng.randint(0, len(ops)), self._tier_op())
        chain = Chain(model, loader, weight_dtype, ops, self._compile_op(model, weight_dtype),
                      self._core_node_op(model))
        self.previous = chain
        return chain

    def _compile_op(self, model: Model, weight_dtype: str) -> dict[str, Any] | None:
        """With ``compile_share``, a torch.compile for the chain (on models whose weights inductor
        compiles as they are: not fp8, not the big Wan)."""
        crng = self.compile_rng
        if (self.compile_share and not model.big and not model.mixed and weight_dtype == "default"
                and model.file_dtype in COMPILED_FILE_DTYPES and crng.random() < self.compile_share):
            return {"op": "compile", "how": crng.choice(COMPILES), "at": crng.random()}
        return None

    def _core_node_op(self, model: Model) -> dict[str, Any] | None:
        """With ``core_node_share``, one of core's MODEL → MODEL nodes, its values drawn from
        their declarations; a second MODEL input gets another file of the model's family (a
        merge's partner), or of any family where the catalogue has none."""
        crng = self.core_rng
        if not self.core_node_share or crng.random() >= self.core_node_share:
            return None
        node = crng.choice(self.core.drawable)
        kin = [m for m in self.models if m.family == model.family and m.name != model.name and not m.mixed] \
            or [m for m in self.models if m.name != model.name]
        return {"op": "core_node", "node": node.name, "model_input": node.models[0], "output": node.output,
                "inputs": {name: core_nodes.draw(crng, value) for name, value in node.values.items()},
                "others": {name: crng.choice(kin).name for name in node.models[1:]}, "at": crng.random()}

    def _offload_op(self, model: Model) -> dict[str, Any]:
        rng = self.rng
        resident = rng.choice((-1, -1, 0, 0, rng.randint(0, model.blocks), model.blocks,
                               model.blocks + 1 if rng.random() < 0.2 else 0))
        return {"op": "offload", "resident_blocks": resident, "vram_budget_gb": rng.choice(BUDGETS_GB),
                "prefetch": rng.choice((1, 2, 3, 8, 16)), "pin": rng.random() < 0.7}

    def _tier_op(self) -> dict[str, Any]:
        rng = self.rng
        budget = rng.choice((0.0, 0.0, 0.001, 0.001, 0.001, 0.5, 4.0))
        return {"op": "tier", "ram_budget_gb": budget, "ram_reserve_gb": rng.choice((0.0, 1.0, 2.0)),
                "vram_reserve_gb": rng.choice((0.0, 1.0)), "disk_tier": rng.random() < 0.8,
                "keep_in_ram": rng.random() < 0.2, "priority": rng.choice((-5, 0, 5))}

    # -- graphs ---------------------------------------------------------------------------------
    def _finish(self, shape: str, chains: list[Chain], *, interrupt: str | None,
                steps: int | None = None, extras: bool = True, swap: bool = False,
                scenario: str | None = None) -> dict[str, Any]:
        """The prompt of these chains; `extras` allows a text encode and a VAE round trip,
        `swap` asks for Model-Level Swap with a text encode."""
        rng = self.rng
        g = Graph()
        tags = {f"shape:{shape}"} | ({f"scenario:{scenario}"} if scenario else set())
        model = chains[0].model
        text_encode = swap or (extras and rng.random() < 0.35)
        swap_wanted = swap or (text_encode and rng.random() < 0.6)
        clip = clip_loader = None
        if text_encode:
            clip_loader = "CLIPLoader" if swap else "TieredCLIPLoader" if rng.random() < 0.35 else "CLIPLoader"
            clip = out(g.add(clip_loader, clip_name=self.cat.clip, type="stable_diffusion",
                             device="default"))
            tags.add(f"loader:{clip_loader}")
        vae = vae_loader = None
        if extras and model.image and rng.random() < 0.3:
            if model.folder == "checkpoints":
                vae_loader = chains[0].loader
            else:
                vae_loader = "TieredVAELoader" if rng.random() < 0.4 else "VAELoader"
                vae = out(g.add(vae_loader, vae_name=self.cat.vae))
            tags.add("vae")

        loaders: dict[int, str] = {}
        model_links = []
        refusals: list[dict[str, Any]] = []
        links = {"clip": clip, "vae": vae}
        tiered = {"clip": clip_loader == "TieredCLIPLoader", "vae": vae_loader == "TieredVAELoader"}
        for n, chain in enumerate(chains):
            if shape == "two_branch" and n == 1:
                loader_id = loaders[0]
            else:
                loader_id = self._loader(g, chain)
                loaders[n] = loader_id
            if vae_loader is not None and model.folder == "checkpoints" and n == 0:
                links["vae"] = out(loader_id, 2)
                tiered["vae"] = chain.loader.startswith("Tiered")
            swap_here = swap_wanted and (n == 1 if shape == "two_branch" else True)
            model_links.append(self._ops(g, chain, out(loader_id), links, tiered, swap_here, tags,
                                         refusals))
            tags.update(self._chain_tags(chain))
            if chain.loader.startswith("Tiered"):
                self._remember_tiered(chain.model.filename)
        if tiered["clip"]:
            self._remember_tiered(self.cat.clip)
        if vae_loader == "TieredVAELoader":
            self._remember_tiered(self.cat.vae)
        vae, encode_clip = links["vae"], links["clip"]

        pos = out(g.add("TieredTestConditioning", model_kind=model.cond_kind, seed=rng.randrange(2**31)))
        pos = self._hook_lora(g, model, pos, tags)
        neg = out(g.add("TieredTestConditioning", model_kind=model.cond_kind, seed=rng.randrange(2**31)))
        latent = out(g.add(model.latent["node"], **model.latent["inputs"]))
        steps = steps or rng.choice((2, 3, 4))
        cfg = rng.choice((1.0, 2.5, 4.0))
        sampler, scheduler = rng.choice(SAMPLERS), rng.choice(SCHEDULERS)
        finals = []
        if shape == "two_stage":
            split = rng.randint(1, steps - 1) if steps > 1 else 1
            common = {"positive": pos, "negative": neg, "cfg": cfg, "sampler_name": sampler,
                      "scheduler": scheduler, "steps": steps, "noise_seed": rng.randrange(2**31)}
            first = g.add("KSamplerAdvanced", model=model_links[0], latent_image=latent, add_noise="enable",
                          start_at_step=0, end_at_step=split, return_with_leftover_noise="enable", **common)
            finals.append(out(g.add("KSamplerAdvanced", model=model_links[1], latent_image=out(first),
                                    add_noise="disable", start_at_step=split, end_at_step=steps,
                                    return_with_leftover_noise="disable", **common)))
        else:
            for link in model_links:
                finals.append(out(g.add("KSampler", model=link, positive=pos, negative=neg,
                                        latent_image=latent, seed=rng.randrange(2**31), steps=steps,
                                        cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                        denoise=rng.choice((1.0, 1.0, 0.75)))))
        for final in finals:
            g.add("TieredTestLatentStats", samples=final)
            if vae is not None:
                image = g.add("VAEDecode", samples=final, vae=vae)
                g.add("TieredTestLatentStats", samples=out(g.add("VAEEncode", pixels=out(image), vae=vae)))
        if encode_clip is not None:
            words = " ".join(rng.sample(WORDS, 3))
            encode = g.add("CLIPTextEncode", clip=encode_clip,
                           text=f"{words}, step {self.seed}.{self.index}")
            g.add("TieredTestConditioningStats", conditioning=out(encode))
            tags.add("text_encode")
        if interrupt:
            tags.add(f"interrupt:{interrupt}")
        if self.capped_budget:
            refusals.append({"kind": "tier_capacity"})
        wf = g.to_api()
        return {"op": "prompt", "index": self.index, "p": wf, "q": strip(wf), "interrupt": interrupt,
                "packing_blocks": chains[0].model.blocks if interrupt == "packing" else None,
                "allowed_refusals": refusals, "tags": sorted(tags),
                "models": [c.model.name for c in chains]}

    def _hook_lora(self, g: Graph, model: Model, pos: list, tags: set[str]) -> list:
        """With ``hook_share``, a hook LoRA of the model's family on the positive, sometimes with
        keyframes that change its strength part-way through the run."""
        hrng = self.hook_rng
        if not model.adapters or hrng.random() >= self.hook_share:
            return pos
        adapter = hrng.choice(model.adapters)
        hooks = out(g.add("CreateHookLoraModelOnly", lora_name=adapter.filename,
                          strength_model=hrng.choice(HOOK_STRENGTHS)))
        if hrng.random() < 0.4:
            first = g.add("CreateHookKeyframe", strength_mult=hrng.choice((0.0, 0.5)), start_percent=0.0)
            second = g.add("CreateHookKeyframe", strength_mult=1.0, start_percent=hrng.choice((0.3, 0.6)),
                           prev_hook_kf=out(first))
            hooks = out(g.add("SetHookKeyframes", hooks=hooks, hook_kf=out(second)))
            tags.add("hook_lora:keyframes")
        tags.add("hook_lora")
        return out(g.add("ConditioningSetProperties", cond_NEW=pos, strength=1.0, set_cond_area="default",
                         hooks=hooks))

    def _loader(self, g: Graph, chain: Chain) -> str:
        if chain.model.folder == "checkpoints":
            return g.add(chain.loader, ckpt_name=chain.model.filename)
        return g.add(chain.loader, unet_name=chain.model.filename, weight_dtype=chain.weight_dtype)

    def _ops(self, g: Graph, chain: Chain, model: list, links: dict[str, list | None],
             tiered: dict[str, bool], swap: bool, tags: set[str], refusals: list[dict[str, Any]]) -> list:
        """Add the chain's operations and return its final model link. `links` holds the current
        CLIP and VAE links; a tier manager or a swap that passes them through updates them."""
        ops = list(chain.ops)
        if swap and links["clip"] is not None:
            offload_at = next((i for i, op in enumerate(ops) if op["op"] == "offload"), None)
            if offload_at is not None and self.rng.random() < 0.12:
                ops.insert(offload_at, {"op": "swap"})  # before the offload: a documented refusal
            else:
                ops.insert(self.rng.randint(0 if offload_at is None else offload_at + 1, len(ops)),
                           {"op": "swap"})
        if chain.compile is not None:
            ops.insert(int(chain.compile["at"] * (len(ops) + 1)), chain.compile)
        if chain.core_node is not None:
            ops.insert(int(chain.core_node["at"] * (len(ops) + 1)), chain.core_node)
            kinds = [op["op"] for op in ops]
            tags.update({"core_node", f"core_node:{chain.core_node['node']}"})
            if "offload" in kinds:
                tags.add("core_node:before_offload" if kinds.index("core_node") < kinds.index("offload")
                         else "core_node:after_offload")
        swapped = False
        for op in ops:
            kind = op["op"]
            if kind == "lora":
                model = out(g.add("LoraLoaderModelOnly", model=model, lora_name=op["adapter"],
                                  strength_model=op["strength"]))
            elif kind == "offload":
                settings = {k: op[k] for k in ("resident_blocks", "vram_budget_gb", "prefetch", "pin")}
                node = g.add("ApplyLayerwiseOffload", model=model, **settings)
                model = out(node)
                refusals.extend(self._offload_refusals(chain, op, node, swapped))
            elif kind == "swap":
                node = g.add("ModelLevelSwap", model=model, clip=links["clip"])
                model, links["clip"], swapped = out(node, 0), out(node, 1), True
                tags.add("swap")
            elif kind == "tier":
                inputs = {k: op[k] for k in ("ram_budget_gb", "ram_reserve_gb", "vram_reserve_gb",
                                             "disk_tier", "keep_in_ram", "priority")}
                passed = [name for name in ("clip", "vae")
                          if links[name] is not None and tiered[name] and self.rng.random() < 0.5]
                node = g.add("VRAMTierManager", model=model, **inputs,
                             **{name: links[name] for name in passed})
                model = out(node)
                for name in passed:
                    links[name] = out(node, 1 if name == "clip" else 2)
                    tags.add(f"tier_manager:{name}")
                if not chain.loader.startswith("Tiered"):
                    refusals.append({"kind": "tier_untracked", "node": node})
                # Any cap can refuse a load: a model in use is never evicted, and with the disk
                # tier off no idle model is dropped either (seed 7 of a long run: 0.5 GiB, no
                # disk tier, 1.3 GiB parked). The cap stays two prompts, then is lifted.
                if op["ram_budget_gb"] > 0:
                    self.capped_budget = True
                    self.lift_after = self.lift_after or 2
                if 0 < op["ram_budget_gb"] < 0.01:
                    tags.add("tiny_budget")
            elif kind == "core_node":
                inputs = {**op["inputs"], op["model_input"]: model}
                for name, other in op["others"].items():
                    partner = next(m for m in self.cat.models if m.name == other)
                    inputs[name] = out(self._loader(g, Chain(partner, "CheckpointLoaderSimple"
                                                             if partner.folder == "checkpoints" else "UNETLoader")))
                model = out(g.add(op["node"], **inputs), op["output"])
            elif kind == "block_replace":
                model = out(g.add("TieredTestBlockReplace", model=model, scale=op["scale"]))
            elif kind == "compile":
                model = out(g.add("TorchCompileModel", model=model, backend="inductor")
                            if op["how"] == "whole" else
                            g.add("TieredTestCompileBlocks", model=model, how="core_wrapper_block_keys",
                                  backend="inductor", mode="default", fullgraph=False, dynamic="auto"))
        return model

    def _offload_refusals(self, chain: Chain, op: dict[str, Any], node: str, swapped: bool
                          ) -> list[dict[str, Any]]:
        m = chain.model
        found = []
        resident, budget = op["resident_blocks"], op["vram_budget_gb"] * GIB
        if resident > m.blocks:
            found.append({"kind": "resident_out_of_range", "node": node})
        # A budget below this may be refused as too small (a generous bound: the exact need
        # depends on prefetch, dtype and shared parts); above it, a refusal is a mismatch.
        roomy = 4 * (m.blocks + 2) * m.block_bytes + SHARED_MIB * 2**20
        if resident == -1 and budget < roomy:
            found.append({"kind": "budget_too_small", "node": node})
        if swapped:
            found.append({"kind": "swap_before_offload", "node": node})
        streamed = 0 <= resident < m.blocks or (resident == -1 and budget < roomy)
        patched = set()
        for lora in chain.adapters():
            if lora["strength"] != 0:
                adapter = next(a for a in m.adapters if a.filename == lora["adapter"])
                patched |= {k[: -len(".weight")] for k in adapter.keys}
        if streamed and any(q.startswith("blocks.") for q in m.quantized & patched):
            found.append({"kind": "quantized_lora_streamed"})
        if streamed and chain.compile is not None and chain.compile["how"] == "whole":
            found.append({"kind": "compile_streamed"})
        return found

    def _chain_tags(self, chain: Chain) -> set[str]:
        m = chain.model
        tags = {f"family:{m.family}", f"model:{m.name}", f"file_dtype:{m.file_dtype}",
                f"loader:{chain.loader}"}
        if chain.weight_dtype != "default":
            tags.add(f"weight_dtype:{chain.weight_dtype}")
        kinds = [op["op"] for op in chain.ops]
        loras = chain.adapters()
        if loras:
            tags.add("lora_stack" if len(loras) > 1 else "lora")
        for lora in loras:
            adapter = next(a for a in m.adapters if a.filename == lora["adapter"])
            tags.add(f"adapter:{adapter.kind}")
            s = lora["strength"]
            tags.add("strength:0" if s == 0 else "strength:neg" if s < 0 else
                     "strength:>1" if s > 1 else "strength:(0,1]")
        if "offload" in kinds:
            at = kinds.index("offload")
            op = chain.ops[at]
            r = op["resident_blocks"]
            tags.add("offload")
            tags.add("resident:-1" if r == -1 else "resident:0" if r == 0 else
                     "resident:all" if r == m.blocks else "resident:>all" if r > m.blocks else "resident:k")
            if not op["pin"]:
                tags.add("pin:false")
            if loras:
                before = any(k == "lora" for k in kinds[at:])
                after = any(k == "lora" for k in kinds[:at])
                tags.update({"offload_before_lora"} if before and not after else
                            {"offload_after_lora"} if after and not before else {"offload_between_loras"})
        if "tier" in kinds:
            tags.add("tier_manager")
        if "block_replace" in kinds:
            tags.add("block_replace")
        if chain.compile is not None:
            tags.update({"compile", f"compile:{chain.compile['how']}"})
        return tags

    def _remember_tiered(self, name: str) -> None:
        if name not in self.tiered_names:
            self.tiered_names.append(name)


def generate(seed: int, prompts: int, catalogue: Catalogue, **options: Any) -> list[dict[str, Any]]:
    """The step list for one seed: deterministic for (seed, prompts, catalogue, options)."""
    return Generator(seed, catalogue, **options).sequence(prompts)

"""The model files a differential campaign samples from, written once into a models folder.

Each entry says what the generator needs to build valid prompts for it (family, block count,
conditioning, latent, adapters that fit) and what the refusal rules need (quantized layers).
Files are deterministic for their spec; a manifest beside them records each file's spec so a
changed spec rewrites that file and an unchanged one is reused between runs.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import family_adapters
import tiny_checkpoint
import tiny_flux
import tiny_models
import tiny_vae

log = logging.getLogger(__name__)

# Bump when a writer changes what it writes, so cached files are rewritten.
FIXTURE_VERSION = 1
GIB = 1024 ** 3


@dataclass(frozen=True)
class Adapter:
    filename: str
    kind: str                      # "lora" or "loha"
    keys: frozenset[str]           # patched weights (diffusion-model keys)


@dataclass(frozen=True)
class Model:
    name: str                      # short label used in tags and reports
    filename: str
    family: str                    # "wan", "sd3", "hunyuan_video", "flux"
    folder: str                    # "diffusion_models" or "checkpoints"
    blocks: int                    # blocks Apply Layerwise Offload streams
    block_bytes: int               # largest block in fp32 (an upper bound of what it streams)
    cond_kind: str                 # TieredTestConditioning model_kind with the right widths
    latent: dict[str, Any]
    file_dtype: str
    adapters: tuple[Adapter, ...] = ()
    quantized: frozenset[str] = frozenset()  # fp8 layers of a mixed-precision file
    mixed: bool = False            # every Linear has a custom weight setter
    image: bool = False            # 2-D latent: the tiny TAESD can decode it
    optional: bool = False         # included only where this ComfyUI loads it (probed)
    big: bool = False              # slow enough to interrupt while it is packed


@dataclass
class Catalogue:
    models: list[Model]
    clip: str
    vae: str
    root: Path
    excluded: list[str] = field(default_factory=list)

    def usable(self) -> list[Model]:
        return [m for m in self.models if m.name not in self.excluded]

    def describe(self) -> dict[str, Any]:
        return {"models": [m.name for m in self.usable()], "excluded": list(self.excluded),
                "clip": self.clip, "vae": self.vae}


VIDEO_LATENT = {"node": "EmptyHunyuanLatentVideo",
                "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}}
IMAGE_LATENT = {"node": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}


def _wan_block_bytes(dim: int, ffn: int) -> int:
    return (8 * (dim * dim + dim) + 2 * dim * ffn + dim + ffn + 6 * dim + 6 * dim) * 4


def _wan_adapters(prefix: str, layers: int, dim: int, ffn: int) -> list[tuple[Adapter, Callable, dict]]:
    keys = frozenset(f"{n}.weight" for n, _, _ in tiny_models.wan_lora_targets(layers, dim, ffn))
    keys0 = frozenset(f"{n}.weight" for n, _, _ in tiny_models.wan_lora_targets(1, dim, ffn))
    common = {"dim": dim, "ffn_dim": ffn}
    return [
        (Adapter(f"{prefix}_lora.safetensors", "lora", keys),
         tiny_models.write_tiny_wan_lora, {"model_layers": layers, "seed": 1, **common}),
        (Adapter(f"{prefix}_lora_b.safetensors", "lora", keys),
         tiny_models.write_tiny_wan_lora, {"model_layers": layers, "seed": 9, **common}),
        (Adapter(f"{prefix}_lora_block0.safetensors", "lora", keys0),
         tiny_models.write_tiny_wan_lora, {"model_layers": 1, "seed": 3, **common}),
        (Adapter(f"{prefix}_loha.safetensors", "loha", keys),
         tiny_models.write_tiny_wan_loha, {"model_layers": layers, "seed": 5, **common}),
    ]


def _family_adapters(prefix: str, build: Callable[[], dict]) -> list[tuple[Adapter, Callable, dict]]:
    keys = frozenset(f"{n}.weight" for n, _, _ in family_adapters.linear_weights(build()))

    def writer(path, *, kind, seed):
        return family_adapters.write_adapter(path, build(), kind=kind, seed=seed)

    return [
        (Adapter(f"{prefix}_lora.safetensors", "lora", keys), writer, {"kind": "lora", "seed": 21}),
        (Adapter(f"{prefix}_loha.safetensors", "loha", keys), writer, {"kind": "loha", "seed": 23}),
    ]


def _plan(big: bool) -> tuple[list[Model], list[tuple[str, str, Callable, dict]]]:
    """(models, [(folder, filename, writer, kwargs)]) of the whole catalogue."""
    files: list[tuple[str, str, Callable, dict]] = []
    models: list[Model] = []

    def add_file(folder: str, filename: str, writer: Callable, kwargs: dict) -> None:
        if all(f[1] != filename for f in files):
            files.append((folder, filename, writer, kwargs))

    def adapters_of(entries) -> tuple[Adapter, ...]:
        for adapter, writer, kwargs in entries:
            add_file("loras", adapter.filename, writer, kwargs)
        return tuple(a for a, _, _ in entries)

    tiny_wan = adapters_of(_wan_adapters("dt_wan_tiny", 2, 128, 256))
    wan_small = dict(family="wan", folder="diffusion_models", blocks=2, cond_kind="wan21",
                     latent=VIDEO_LATENT, block_bytes=_wan_block_bytes(128, 256), adapters=tiny_wan)
    for name, dtype, label, seed in (("wan_tiny", torch.float32, "fp32", 0),
                                     ("wan_tiny_low", torch.float32, "fp32", 7),
                                     ("wan_tiny_bf16", torch.bfloat16, "bf16", 0),
                                     ("wan_tiny_fp16", torch.float16, "fp16", 0),
                                     ("wan_tiny_fp8", torch.float8_e4m3fn, "fp8_e4m3fn", 0)):
        filename = f"dt_{name}.safetensors"
        add_file("diffusion_models", filename, tiny_models.write_tiny_wan21, {"seed": seed, "dtype": dtype})
        models.append(Model(name=name, filename=filename, file_dtype=label, **wan_small))

    # Mixed precision as in issue 10's case E: fp8 only outside the blocks; and a variant with
    # fp8 layers inside blocks, where a LoRA on them in a streamed block is a documented refusal.
    for name, layers in (
            ("wan_tiny_mixed", ("text_embedding.0", "text_embedding.2", "time_embedding.0",
                                "time_embedding.2", "head.head")),
            ("wan_tiny_mixed_blocks", ("text_embedding.0", "blocks.0.ffn.0", "blocks.1.self_attn.q"))):
        filename = f"dt_{name}.safetensors"
        add_file("diffusion_models", filename, tiny_models.write_tiny_wan21_mixed_precision, {"layers": list(layers)})
        models.append(Model(name=name, filename=filename, file_dtype="mixed_fp8",
                            quantized=frozenset(layers), mixed=True, **wan_small))

    wan_sizes = [("wan_deep", 8, 128, 256), ("wan_mid", 6, 256, 512)]
    if big:
        wan_sizes.append(("wan_big", 16, 1024, 4096))
    for name, layers, dim, ffn in wan_sizes:
        filename = f"dt_{name}.safetensors"
        add_file("diffusion_models", filename, tiny_models.write_tiny_wan21,
                 {"layers": layers, "dim": dim, "ffn_dim": ffn, "seed": 2})
        models.append(Model(name=name, filename=filename, family="wan", folder="diffusion_models",
                            blocks=layers, block_bytes=_wan_block_bytes(dim, ffn),
                            cond_kind="wan21", latent=VIDEO_LATENT, file_dtype="fp32",
                            adapters=adapters_of(_wan_adapters(f"dt_{name}", layers, dim, ffn)),
                            big=name == "wan_big"))

    sd3_adapters = adapters_of(_family_adapters("dt_sd3", tiny_models.build_tiny_sd3))
    sd3 = dict(family="sd3", blocks=2, cond_kind="sd3", latent=IMAGE_LATENT, adapters=sd3_adapters,
               image=True, block_bytes=2 * (3 + 1 + 8 + 6) * 128 * 128 * 4)
    for name, dtype, label in (("sd3", torch.float32, "fp32"), ("sd3_bf16", torch.bfloat16, "bf16")):
        filename = f"dt_{name}.safetensors"
        add_file("diffusion_models", filename, tiny_models.write_tiny_sd3, {"dtype": dtype})
        models.append(Model(name=name, filename=filename, folder="diffusion_models", file_dtype=label,
                            **sd3))
    add_file("checkpoints", "dt_sd3_checkpoint.safetensors", tiny_checkpoint.write_tiny_sd3_checkpoint, {})
    models.append(Model(name="sd3_checkpoint", filename="dt_sd3_checkpoint.safetensors",
                        folder="checkpoints", file_dtype="fp32", **sd3))

    hy_adapters = adapters_of(_family_adapters("dt_hunyuan", tiny_models.build_tiny_hunyuan_video))
    add_file("diffusion_models", "dt_hunyuan_video.safetensors", tiny_models.write_tiny_hunyuan_video, {})
    models.append(Model(name="hunyuan_video", filename="dt_hunyuan_video.safetensors",
                        family="hunyuan_video", folder="diffusion_models", blocks=4,
                        block_bytes=(2 * (6 + 3 + 1 + 8) * 128 * 128) * 4, cond_kind="hunyuan_video",
                        latent=VIDEO_LATENT, file_dtype="fp32",
                        adapters=hy_adapters))

    flux_adapters = adapters_of(_family_adapters("dt_flux", tiny_flux.build_tiny_flux))
    add_file("diffusion_models", "dt_flux.safetensors", tiny_flux.write_tiny_flux, {})
    models.append(Model(name="flux", filename="dt_flux.safetensors", family="flux",
                        folder="diffusion_models", blocks=4,
                        block_bytes=(2 * (6 + 3 + 1 + 8) * 128 * 128) * 4,
                        cond_kind="hunyuan_video", latent=IMAGE_LATENT,
                        file_dtype="fp32", adapters=flux_adapters, image=True, optional=True))

    add_file("text_encoders", tiny_models.CLIP_L_FILENAME, tiny_models.write_random_clip_l, {})
    add_file("vae", "dt_taesd.safetensors", tiny_vae.write_tiny_taesd, {})
    return models, files


def _spec(writer: Callable, kwargs: dict) -> str:
    return json.dumps({"v": FIXTURE_VERSION, "writer": f"{writer.__module__}.{writer.__qualname__}",
                       "kwargs": {k: str(v) for k, v in sorted(kwargs.items())}}, sort_keys=True)


def build(models_root: Path, *, big: bool = True) -> Catalogue:
    """Write (or reuse) every file under models_root/<folder>/ and return the catalogue."""
    models, files = _plan(big)
    manifest_path = models_root / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    for folder, filename, writer, kwargs in files:
        path = models_root / folder / filename
        spec = _spec(writer, kwargs)
        if path.exists() and manifest.get(f"{folder}/{filename}") == spec:
            continue
        log.info("writing fixture %s/%s", folder, filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        writer(path, **kwargs)
        manifest[f"{folder}/{filename}"] = spec
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return Catalogue(models=models, clip=tiny_models.CLIP_L_FILENAME, vae="dt_taesd.safetensors",
                     root=models_root)

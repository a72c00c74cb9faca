"""Disk streaming benchmark: how close the disk tier comes to the disk, and what it costs a step.

Wan-shaped blocks (bench/layerwise.py's) in random weights are written to a safetensors file in
--dir, which the disk tier's spill file shares. Per granularity (block, phase) one run measures:
  * raw: one thread reading the whole model file sequentially in 16 MiB buffered reads, GiB/s:
    what the disk gives one reader;
  * ram: the all-in-RAM engine (host_cache 0: every block packed in RAM), step time;
  * disk: the disk tier with a host cache of --cache-share of the blocks' bytes (at least what
    streaming needs at once), reading its spill file with --workers threads:
      - step time, and its ratio to the all-in-RAM step;
      - disk read GiB/s: the bytes the tier read over the wall time with a read in flight;
      - that rate over the raw read (the goal is >= 0.85 of the cold one: the spill file is read
        with O_DIRECT where the file system allows it, past the page cache, so its reads come
        from the disk in both states);
      - cache hit rate, and the time compute waited for the disk;
      - whether the output equals the resident reference bit for bit.
Each "disk" figure is taken warm and cold. Cold drops the spill file from the page cache before
every measured pass: posix_fadvise(DONTNEED), and with --drop-caches (root only) a write to
/proc/sys/vm/drop_caches (direct reads, where the file system allows them, never use the cache).
The raw read is taken in the same states.
Read-ahead (``read_ahead`` in the JSON, its own table): cold passes through a cache of
--read-ahead-units units, read ahead by 1, 2 and 4 workers (each reads one unit ahead) and by
``auto`` (the engine's tuner chooses how far, after measuring its first passes): step time, cache
hit rate and bytes read per step. Prints a table, writes
JSON (device, torch, settings) to bench/results/. ``--smoke`` runs tiny shapes on the CPU in a few
seconds so the script never rots; no timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from layerwise import Spec, Stack, build_blocks, timed, write_result  # noqa: E402

from offload_core.disk.store import PAGE, align_up  # noqa: E402
from offload_core.disk.tier import DiskOptions  # noqa: E402
from offload_core.layerwise.streamer import LayerwiseStreamer  # noqa: E402

GIB = 1 << 30
READ_PIECE = 16 << 20


def drop_file_cache(path: Path, drop_all: bool) -> str:
    """Make the next reads of ``path`` come from the disk; returns how."""
    how = []
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            how.append("fadvise")
        finally:
            os.close(fd)
    if drop_all:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            how.append("drop_caches")
        except OSError:
            pass
    return "+".join(how) or "none"


def raw_read_gibps(path: Path, cold: bool, drop_all: bool) -> float:
    """One thread, sequential 16 MiB buffered reads of the whole file (cold: the page cache dropped first)."""
    if cold:
        drop_file_cache(path, drop_all)
    buf = bytearray(READ_PIECE)
    view = memoryview(buf)
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total / (time.perf_counter() - start) / GIB


def write_model(blocks: list[torch.nn.Module], path: Path) -> int:
    sd = {f"blocks.{i}.{name}": t for i, b in enumerate(blocks) for name, t in b.state_dict().items()}
    save_file({k: t.contiguous() for k, t in sd.items()}, str(path), {"bench": "disk_stream"})
    return path.stat().st_size


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def run_ram(stack: Stack, device: torch.device, granularity: str, args) -> dict:
    st = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch, granularity=granularity)
    st.attach()
    try:
        stack()  # warm-up, and the prefetch wraps around
        steps = timed(device, stack, args.steps)
        return {"step_s": statistics.median(steps), "units": len(st.units), "bound_bytes": st.bound_bytes()}
    finally:
        st.close()


def run_disk(stack: Stack, device: torch.device, granularity: str, path: Path, raw: dict, ref: torch.Tensor,
             args) -> dict:
    probe = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                              granularity=granularity)
    unit = align_up(max(p.nbytes for p in probe._plan.packs), PAGE)
    least = (probe._plan.nslots + 1) * unit
    cap = max(least, int(args.cache_share * sum(p.nbytes for p in probe._plan.packs)))
    del probe
    options = DiskOptions(cap_bytes=cap, workers=args.workers, spill_dir=str(path.parent))
    st = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                           granularity=granularity, disk=options)
    start = time.perf_counter()
    st.attach()
    attach_s = time.perf_counter() - start
    out = {"cache_bytes": st.disk_figures()["cache_bytes"], "attach_s": attach_s,
           "spill_bytes": st.disk_figures()["spill_bytes"]}
    try:
        with torch.no_grad():
            out["matches_reference"] = torch.equal(_bits(stack()), ref)  # also the warm-up pass
        for state in ("warm", "cold"):
            passes = []
            for _ in range(args.steps):
                dropped = None
                if state == "cold":
                    st._store.disk.store.drop_cached_pages()
                    dropped = drop_file_cache(path, args.drop_caches)
                st.reset_figures()
                step = timed(device, stack, 1)[0]
                figures = st.figures(wait=True)
                passes.append((step, figures, dropped))
            read = sum(f["disk_bytes_read"] for _, f, _ in passes)
            busy = sum(f["disk_read_busy_s"] for _, f, _ in passes)
            requests = sum(f["cache_requests"] for _, f, _ in passes)
            gibps = read / busy / GIB if busy > 0 else None
            out[state] = {
                "step_s": statistics.median(s for s, _, _ in passes),
                "disk_read_gibps": gibps,
                "raw_gibps": raw[state],
                "vs_raw": gibps / raw[state] if gibps else None,
                "cache_hit_rate": sum(f["cache_hits"] for _, f, _ in passes) / requests if requests else None,
                "disk_bytes_read_per_step": read / len(passes),
                "disk_wait_s_per_step": sum(f["disk_wait_s"] for _, f, _ in passes) / len(passes),
                "compute_wait_s_per_step": sum(f["compute_wait_s"] for _, f, _ in passes) / len(passes),
                "page_cache_dropped_by": passes[0][2],
                "order_misses": sum(f["order_misses"] for _, f, _ in passes),
                "sync_fallbacks": sum(f["sync_fallbacks"] for _, f, _ in passes),
            }
    finally:
        st.close()
    return out


READ_AHEAD = ("1", "2", "4", "auto")  # disk_workers settings compared; auto: read-ahead planned
AUTO_WARM_PASSES = 24  # at most: the tuner measures, plans, applies and checks within these


def run_read_ahead(stack: Stack, device: torch.device, granularity: str, path: Path, args) -> dict:
    """Cold passes through a cache of ``args.read_ahead_units`` units, read ahead by 1, 2, 4 workers
    and by auto: step time, hit rate and bytes read per step of each. The settings run in
    ``args.read_ahead_rounds`` rounds, every other one in reverse order, and each figure is over
    all rounds: a host whose load drifts then weighs on every setting alike."""
    probe = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch, granularity=granularity)
    units = len(probe.units)
    entries = min(args.read_ahead_units, units - 2)  # the model must not fit the cache
    cap = entries * align_up(max(p.nbytes for p in probe._plan.packs), PAGE)
    del probe
    measured: dict[str, list[tuple[float, dict]]] = {name: [] for name in READ_AHEAD}
    tunings: dict[str, dict | None] = {}
    for round_ in range(args.read_ahead_rounds):
        for name in READ_AHEAD if round_ % 2 == 0 else READ_AHEAD[::-1]:
            auto = name == "auto"
            options = DiskOptions(cap_bytes=cap, workers=2 if auto else int(name), spill_dir=str(path.parent),
                                  read_ahead="auto" if auto else None)
            st = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                                   granularity=granularity, disk=options)
            st.attach(root=stack if auto else None)
            try:
                warm = 0  # warm-up passes, cold too (auto: until the tuner holds its setting)
                while warm < 2 or auto and warm < AUTO_WARM_PASSES and st.tuning()["phase"] != "hold":
                    st._store.disk.store.drop_cached_pages()
                    drop_file_cache(path, args.drop_caches)
                    stack()
                    warm += 1
                for _ in range(args.steps):
                    st._store.disk.store.drop_cached_pages()
                    drop_file_cache(path, args.drop_caches)
                    st.reset_figures()
                    step = timed(device, stack, 1)[0]
                    measured[name].append((step, st.figures(wait=True)))
                tunings[name] = st.tuning()
            finally:
                st.close()
    out: dict = {"cache_bytes": cap, "cache_units": entries, "units": units,
                 "rounds": args.read_ahead_rounds, "settings": {}}
    for name, passes in measured.items():
        requests = sum(f["cache_requests"] for _, f in passes)
        tuning = tunings[name]
        out["settings"][name] = {
            "step_s": statistics.median(s for s, _ in passes),
            "cache_hit_rate": sum(f["cache_hits"] for _, f in passes) / requests if requests else None,
            "disk_bytes_read_per_step": sum(f["disk_bytes_read"] for _, f in passes) / len(passes),
            "read_ahead": tuning["setting"]["read_ahead"] if name == "auto" else int(name),
            "tuning": tuning,
        }
    best = min(r["step_s"] for n, r in out["settings"].items() if n != "auto")
    out["auto_vs_best_fixed"] = out["settings"]["auto"]["step_s"] / best
    return out


def print_read_ahead(result: dict) -> None:
    head = f"{'unit':<6} {'disk_workers':<12} {'read-ahead':>10} {'step s':>8} {'hit rate':>8} {'MiB read/step':>13}"
    print(head)
    print("-" * len(head))
    for g, row in result["granularity"].items():
        ra = row["read_ahead"]
        for name, r in ra["settings"].items():
            hit = f"{100 * r['cache_hit_rate']:.0f}%" if r["cache_hit_rate"] is not None else "-"
            print(f"{g:<6} {name:<12} {r['read_ahead']:>10} {r['step_s']:>8.4f} {hit:>8} "
                  f"{r['disk_bytes_read_per_step'] / (1 << 20):>13.1f}")
        print(f"{g:<6} auto / best fixed step: {ra['auto_vs_best_fixed']:.3f} (cache of {ra['cache_units']} "
              f"of {ra['units']} units, {ra['rounds']} rounds)")


def specs(args) -> Spec:
    if args.smoke:
        return Spec("wan-smoke", "wan", dim=64, heads=4, tokens=16, ctx=8, blocks=6, ffn=128)
    return Spec("wan-disk", "wan", dim=args.dim, heads=args.dim // 128, tokens=args.tokens, ctx=64,
                blocks=args.blocks, ffn=args.ffn)


def print_table(result: dict) -> None:
    raw = result["raw"]
    print(f"device: {result['device']}  torch {result['torch']}  file {result['file_bytes'] / (1 << 20):.1f} MiB  "
          f"raw read {raw['warm']:.2f} GiB/s warm, {raw['cold']:.2f} GiB/s cold ({raw['cold_dropped_by']})")
    head = (f"{'unit':<6} {'state':<5} {'ram step s':>10} {'disk step s':>11} {'x ram':>6} {'read GiB/s':>10} "
            f"{'/ raw':>6} {'hit rate':>8} {'disk wait s':>11} {'cache MiB':>9} {'bits':>5}")
    print(head)
    print("-" * len(head))
    for g, row in result["granularity"].items():
        for state in ("warm", "cold"):
            d = row["disk"][state]
            rate = f"{d['disk_read_gibps']:.2f}" if d["disk_read_gibps"] else "-"
            ratio = f"{d['vs_raw']:.2f}" if d["vs_raw"] else "-"
            hit = f"{100 * d['cache_hit_rate']:.0f}%" if d["cache_hit_rate"] is not None else "-"
            print(f"{g:<6} {state:<5} {row['ram']['step_s']:>10.4f} {d['step_s']:>11.4f} "
                  f"{d['step_s'] / row['ram']['step_s']:>6.2f} {rate:>10} {ratio:>6} {hit:>8} "
                  f"{d['disk_wait_s_per_step']:>11.4f} {row['disk']['cache_bytes'] / (1 << 20):>9.1f} "
                  f"{'same' if row['disk']['matches_reference'] else 'DIFF':>5}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, a few seconds")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--granularity", default="block,phase")
    ap.add_argument("--cache-share", type=float, default=0.25, help="host cache as a share of the blocks' bytes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="measured passes per state")
    ap.add_argument("--dir", type=Path, default=None, help="folder for the model file (default: a temp folder)")
    ap.add_argument("--drop-caches", action="store_true", help="also drop the whole page cache when cold (root)")
    ap.add_argument("--read-ahead-units", type=int, default=6,
                    help="cache size, in units, of the read-ahead comparison (1, 2, 4 workers and auto)")
    ap.add_argument("--read-ahead-rounds", type=int, default=2,
                    help="rounds of that comparison, every other one in reverse order")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/disk_stream-<device>-<time>.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.steps = min(args.steps, 2)
        args.read_ahead_rounds = 1
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = specs(args)
    torch.manual_seed(0)
    blocks = build_blocks(spec, device=torch.device("cpu"), dtype=torch.bfloat16)  # the host copy
    stack = Stack(spec, device, blocks=blocks)
    resident = Stack(spec, device, blocks=[copy.deepcopy(b).to(device) for b in blocks])
    ref = _bits(resident())  # every block on the device: the reference
    del resident
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "disk_stream_model.safetensors"
        file_bytes = write_model(blocks, path)
        raw = {"cold": raw_read_gibps(path, True, args.drop_caches),
               "warm": raw_read_gibps(path, False, args.drop_caches),
               "cold_dropped_by": drop_file_cache(path, args.drop_caches)}
        result = {
            "device": name, "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "spec": vars(spec), "file_bytes": file_bytes,
            "block_bytes": sum(t.numel() * t.element_size() for b in blocks for t in b.state_dict().values()),
            "raw": raw, "granularity": {},
        }
        for g in args.granularity.split(","):
            result["granularity"][g] = {"ram": run_ram(stack, device, g, args),
                                        "disk": run_disk(stack, device, g, path, raw, ref, args),
                                        "read_ahead": run_read_ahead(stack, device, g, path, args)}
    print_table(result)
    print_read_ahead(result)
    write_result(result, "disk_stream", name, args)
    return result


if __name__ == "__main__":
    main()

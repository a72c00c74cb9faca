"""Disk streaming benchmark: the model's own file against the spill file, and both against the disk.

Wan-shaped blocks (bench/layerwise.py's) in random bf16 weights are written to a safetensors file
in --dir and loaded from it as a loader does (copied into the model's tensors). Then, in one run,
per mode:
  * direct: the disk tier is told the file and where each tensor is in it (its header), so it
    reads the blocks in place (the path of a model whose loaded tensors are its file's bytes);
  * spill: the disk tier is not told the file, so it writes every block to a spill file of its own
    in --dir first (the path of a cast or converted model).
Each mode measures:
  * first step: seconds from the start of the run (the attach, where a prompt's sampling starts
    it) to the end of the first step (a pass over every block), and that time over the time a
    direct read of the blocks' bytes takes (the goal is a first step no later than a pass's
    reads, so about 1);
  * bytes written to disk until then: the engine's own count, and the process's (Linux
    /proc/self/io write_bytes, which also counts what others in it write);
  * --passes measured passes after it, bracketed by a direct read of the model file before and
    after, read the way the engine reads (as many threads as its readers, each reading one unit's
    bytes at a time, O_DIRECT where the file system allows it): the disk's rate
    drifts by 2-3x within minutes on shared machines, so the yardstick is taken around the pass.
    The engine's read rate by its telemetry (bytes over the time its reads were in flight), its
    wall rate (bytes read over the passes' wall time) and P8, the wall rate over the mean of the
    two direct reads: the goal is P8 >= 0.95 in the default setting, which is disk-bound (16
    tokens, so compute is trivial; a cache of 6 units, so nearly every block is read every pass);
  * the cache hit rate, the time compute waited for the disk, and whether the output equals
    every block resident, bit for bit.
Read-ahead (``read_ahead`` in the JSON, its own table): cold passes over the model's own file
through a cache of --read-ahead-units units, read ahead by 1, 2 and 4 workers (each reads one unit
ahead) and by ``auto`` (the engine's tuner chooses how far, after measuring its first passes):
step time, cache hit rate and bytes read per step, each setting in an engine of its own, the
engines taking turns in --read-ahead-rounds rounds; and ``1 again``, one worker once more in a
fifth engine, whose step against the first's (``same_setting_spread``) says how far apart two
engines of one setting come out on this disk: what a difference between settings must exceed.
Each setting's step is the median of its passes and their mean (what many steps take, each), with
every pass's step in the JSON. ``--read-limit-mib-s`` (root) holds the run's reads to a fixed rate
by the kernel's block throttle, so a disk that drifts weighs on no setting: the steps then differ
by what each setting reads and when.
The page cache is dropped for both files before the measured passes (posix_fadvise DONTNEED, and
with --drop-caches, as root, the whole cache). Prints a table, writes JSON (device, torch,
settings) to bench/results/. ``--smoke`` runs tiny shapes on the CPU in seconds so the script never
rots; no timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import atexit
import datetime as dt
import logging
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from layerwise import Spec, Stack, build_blocks, timed, write_result  # noqa: E402

from offload_core.disk.file_headers import safetensors_tensors  # noqa: E402
from offload_core.disk.in_place import ModelFileMap  # noqa: E402
from offload_core.alignment import PAGE, align_up  # noqa: E402
from offload_core.files.raw_io import read_into  # noqa: E402
from offload_core.disk.tier import AUTO_READERS, DiskOptions  # noqa: E402
from offload_core.layerwise.streamer import LayerwiseStreamer  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
READ_PIECE = 16 << 20
MODES = ("direct", "spill")


def drop_file_cache(path: Path, drop_all: bool) -> str:
    """Make the next reads of ``path`` come from the disk; returns how."""
    how = []
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
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


CGROUP_NAME = "tiered-offload-disk-bench"


def whole_disk(folder: Path) -> str:
    """``major:minor`` of the disk that holds ``folder`` (a partition's parent disk: the block
    throttle takes whole disks)."""
    st = os.stat(folder)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if (sys_dev / "partition").exists():
        dev = (sys_dev.resolve().parent / "dev").read_text().strip()
    return dev


def limit_reads(folder: Path, mib_s: int) -> dict:
    """Hold this process's reads from the disk under ``folder`` to ``mib_s`` MiB/s by the kernel's
    block throttle (Linux, as root; cgroup v1 ``blkio`` or v2 ``io``). Why: a shared machine's
    disk drifts 2-3x within minutes, and two engines of one read-ahead setting then come out up to
    24% apart; at a rate the disk always reaches, every setting reads at the same rate and the
    step times compare what the settings read and when (a SATA SSD reads about 550 MB/s).
    Raises SystemExit with the reason where it cannot."""
    dev, rate = whole_disk(folder), mib_s * MIB
    v1 = Path("/sys/fs/cgroup/blkio")
    try:
        if v1.is_dir():
            group = v1 / CGROUP_NAME
            group.mkdir(exist_ok=True)
            (group / "blkio.throttle.read_bps_device").write_text(f"{dev} {rate}\n")
            how = "cgroup v1 blkio.throttle.read_bps_device"
        else:
            root = Path("/sys/fs/cgroup")
            (root / "cgroup.subtree_control").write_text("+io\n")
            group = root / CGROUP_NAME
            group.mkdir(exist_ok=True)
            (group / "io.max").write_text(f"{dev} rbps={rate}\n")
            how = "cgroup v2 io.max"
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise SystemExit(f"--read-limit-mib-s needs root and the kernel's block throttle (cgroup "
                         f"blkio or io) for disk {dev}: {exc}") from exc
    atexit.register(leave_group, group)
    return {"mib_s": mib_s, "device": dev, "how": how}


def leave_group(group: Path) -> None:
    """Back to the parent group, and the group removed: a run leaves no cgroup behind."""
    try:
        (group.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
        group.rmdir()
    except OSError as exc:
        print(f"could not remove the cgroup {group}: {exc}", file=sys.stderr)


def direct_read(path: Path, drop_all: bool, piece: int = READ_PIECE, readers: int = 1) -> dict:
    """The whole file read the way the engine reads it: ``readers`` threads, each reading pieces
    of ``piece`` bytes (the engine's unit) in turn, O_DIRECT where allowed (else cold buffered
    reads): GiB/s, and how."""
    direct = getattr(os, "O_DIRECT", 0)
    try:
        if not direct:
            raise OSError("this OS has no O_DIRECT")
        fd, how = os.open(path, os.O_RDONLY | direct), "O_DIRECT"
    except OSError:
        drop_file_cache(path, drop_all)
        fd, how, direct = os.open(path, os.O_RDONLY), "buffered, page cache dropped", 0
    piece = max(PAGE, piece // PAGE * PAGE)
    size = os.fstat(fd).st_size
    totals = [0] * readers

    def read(k: int) -> None:
        buf = mmap.mmap(-1, piece)  # page-aligned, as direct reads need
        try:
            with memoryview(buf) as view:
                for offset in range(k * piece, size, readers * piece):
                    totals[k] += read_into(fd, [view], offset, direct=bool(direct))
        finally:
            buf.close()

    start = time.perf_counter()
    try:
        threads = [threading.Thread(target=read, args=(k,)) for k in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return {"gibps": sum(totals) / (time.perf_counter() - start) / GIB, "how": how,
            "piece_bytes": piece, "readers": readers}


def write_model(blocks: list[torch.nn.Module], path: Path) -> int:
    sd = {f"blocks.{i}.{name}": t for i, b in enumerate(blocks) for name, t in b.state_dict().items()}
    save_file({k: t.contiguous() for k, t in sd.items()}, str(path), {"bench": "disk_stream"})
    return path.stat().st_size


def load_stack(spec: Spec, device: torch.device, path: Path) -> Stack:
    """A model loaded from the file as a loader does: fresh tensors, the file's values copied in."""
    blocks = build_blocks(spec, device=torch.device("cpu"), dtype=torch.bfloat16)
    sd = load_file(str(path))
    for i, b in enumerate(blocks):
        b.load_state_dict({k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")})
    del sd
    return Stack(spec, device, blocks=blocks)


def file_map(stack: Stack, path: Path) -> ModelFileMap:
    """Where each block tensor is in the file, from its header."""
    found = safetensors_tensors(str(path))
    tensors = {}
    for i, b in enumerate(stack.blocks):
        for name in b.state_dict():
            offset, nbytes, _ = found[f"blocks.{i}.{name}"]
            tensors[(i, name)] = (offset, nbytes, torch.bfloat16)
    return ModelFileMap(str(path), tensors)


def written_bytes() -> int | None:
    """Bytes this process caused to be written to storage so far (Linux), else None."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def run_mode(mode: str, spec: Spec, device: torch.device, path: Path, ref: torch.Tensor, args) -> dict:
    stack = load_stack(spec, device, path)
    probe = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                              granularity=args.granularity)
    unit = max(p.nbytes for p in probe._plan.packs)
    streamed = sum(p.nbytes for p in probe._plan.packs)
    del probe
    options = DiskOptions(cap_bytes=args.cache_units * -(-unit // 4096) * 4096, workers=args.workers,
                          spill_dir=str(path.parent), model_file=file_map(stack, path) if mode == "direct" else None)
    st = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                           granularity=args.granularity, disk=options)
    drop_file_cache(path, args.drop_caches)
    before = written_bytes()
    start = time.perf_counter()
    st.attach()
    first_out = stack()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_step = time.perf_counter() - start
    after = written_bytes()
    disk = st.disk_figures()
    out = {"first_step_s": first_step, "attach_figures": disk,
           "written_bytes_engine": disk["spill_written_bytes"],
           "written_bytes_process": after - before if before is not None and after is not None else None,
           "streamed_bytes": streamed, "cache_bytes": disk["cache_bytes"],
           "matches_reference": torch.equal(_bits(first_out), ref)}
    try:
        st._store.disk.sources.drop_cached_pages()
        drop_file_cache(path, args.drop_caches)
        bracket_before = direct_read(path, args.drop_caches, unit, args.workers)
        st.reset_figures()
        steps = timed(device, stack, args.passes)
        figures = st.figures(wait=True)
        bracket_after = direct_read(path, args.drop_caches, unit, args.workers)
        with torch.no_grad():
            out["matches_reference"] = out["matches_reference"] and torch.equal(_bits(stack()), ref)
    finally:
        st.close()
    wall = sum(steps)
    yardstick = statistics.mean([bracket_before["gibps"], bracket_after["gibps"]])
    wall_gibps = figures["disk_bytes_read"] / wall / GIB if wall > 0 else None
    out.update({
        "direct_read_before_gibps": bracket_before["gibps"], "direct_read_after_gibps": bracket_after["gibps"],
        "direct_read_how": bracket_before["how"],
        "first_step_vs_pass_reads": first_step / (streamed / GIB / yardstick),
        "passes": args.passes, "pass_s": statistics.median(steps),
        "disk_bytes_read_per_pass": figures["disk_bytes_read"] / args.passes,
        "engine_read_gibps": figures["disk_read_gibps"],
        "wall_read_gibps": wall_gibps,
        "p8": wall_gibps / yardstick if wall_gibps else None,
        "engine_busy_share": figures["disk_read_busy_s"] / wall if wall > 0 else None,
        "cache_hit_rate": figures["cache_hit_rate"],
        "disk_wait_s_per_pass": figures["disk_wait_s"] / args.passes,
        "order_misses": figures["order_misses"], "sync_fallbacks": figures["sync_fallbacks"],
        "disk_read_errors": figures["disk_read_errors"],
    })
    return out


# disk_workers settings compared; auto: read-ahead planned. "1 again": the first setting once more, in
# an engine of its own: how far two engines of one setting differ on this disk (the figures' floor).
READ_AHEAD = ("1", "2", "4", "auto", "1 again")
FIXED = ("1", "2", "4")
AUTO_WARM_PASSES = 24  # at most: the tuner measures, plans, applies and checks within these


def run_read_ahead(spec: Spec, device: torch.device, path: Path, args) -> dict:
    """Cold passes through a cache of ``args.read_ahead_units`` units, read ahead by 1, 2, 4 workers
    and by auto: step time, hit rate and bytes read per step of each. Every setting has its own
    engine, packed once and kept (attached for its turn, detached keeping its pack after it), and
    the settings take turns in ``args.read_ahead_rounds`` rounds, each starting one setting later
    than the last: a disk whose rate drifts within minutes then weighs on every setting alike,
    where a run of one setting after another would time each in its own minutes. At each turn
    an engine makes two cold passes first (auto: until its tuner holds its setting again, as at
    the start of any run), then ``args.passes`` timed ones. The units are read from the model's
    own file."""
    stack, granularity = load_stack(spec, device, path), args.granularity
    probe = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch, granularity=granularity)
    units = len(probe.units)
    entries = min(args.read_ahead_units, units - 2)  # the model must not fit the cache
    cap = entries * align_up(max(p.nbytes for p in probe._plan.packs), PAGE)
    del probe
    measured: dict[str, list[tuple[float, dict]]] = {name: [] for name in READ_AHEAD}
    tunings: dict[str, dict | None] = {}
    engines: dict[str, LayerwiseStreamer] = {}
    for name in READ_AHEAD:
        auto = name == "auto"
        options = DiskOptions(cap_bytes=cap, workers=AUTO_READERS if auto else _workers(name), spill_dir=str(path.parent),
                              model_file=file_map(stack, path), read_ahead="auto" if auto else None)
        engines[name] = LayerwiseStreamer(list(stack.blocks), device, resident=0, prefetch=args.prefetch,
                                          granularity=granularity, disk=options)
    try:
        for round_ in range(args.read_ahead_rounds):
            for name in READ_AHEAD[round_ % len(READ_AHEAD):] + READ_AHEAD[:round_ % len(READ_AHEAD)]:
                auto, st = name == "auto", engines[name]
                st.attach(root=stack if auto else None)
                try:
                    warm = 0
                    while warm < 2 or auto and warm < AUTO_WARM_PASSES and st.tuning()["phase"] != "hold":
                        st._store.disk.sources.drop_cached_pages()
                        drop_file_cache(path, args.drop_caches)
                        stack()
                        warm += 1
                    for _ in range(args.passes):
                        st._store.disk.sources.drop_cached_pages()
                        drop_file_cache(path, args.drop_caches)
                        st.reset_figures()
                        step = timed(device, stack, 1)[0]
                        measured[name].append((step, st.figures(wait=True)))
                    tunings[name] = st.tuning()
                finally:
                    st.detach(keep_pack=True)
    finally:
        for st in engines.values():
            st.close()
    out: dict = {"cache_bytes": cap, "cache_units": entries, "units": units,
                 "rounds": args.read_ahead_rounds, "settings": {}}
    for name, passes in measured.items():
        requests = sum(f["cache_requests"] for _, f in passes)
        tuning = tunings[name]
        out["settings"][name] = {
            "step_s": statistics.median(s for s, _ in passes),
            "mean_step_s": statistics.mean(s for s, _ in passes),  # what many steps take, each
            "cache_hit_rate": sum(f["cache_hits"] for _, f in passes) / requests if requests else None,
            "disk_bytes_read_per_step": sum(f["disk_bytes_read"] for _, f in passes) / len(passes),
            "read_ahead": tuning["setting"]["read_ahead"] if name == "auto" else _workers(name),
            "steps_s": [s for s, _ in passes],  # in the order taken, round by round
            "tuning": tuning,
        }
    best = min(out["settings"][n]["step_s"] for n in FIXED)
    out["auto_vs_best_fixed"] = out["settings"]["auto"]["step_s"] / best
    best_mean = min(out["settings"][n]["mean_step_s"] for n in FIXED)
    out["auto_vs_best_fixed_mean"] = out["settings"]["auto"]["mean_step_s"] / best_mean
    same = out["settings"]["1"]["step_s"], out["settings"]["1 again"]["step_s"]
    out["same_setting_spread"] = max(same) / min(same) - 1
    return out


def print_read_ahead(result: dict) -> None:
    ra, g = result["read_ahead"], result["settings"]["granularity"]
    head = (f"{'unit':<6} {'disk_workers':<12} {'read-ahead':>10} {'step s':>8} {'mean s':>8} {'hit rate':>8} "
            f"{'MiB read/step':>13}")
    print(head)
    print("-" * len(head))
    for name, r in ra["settings"].items():
        hit = f"{100 * r['cache_hit_rate']:.0f}%" if r["cache_hit_rate"] is not None else "-"
        print(f"{g:<6} {name:<12} {r['read_ahead']:>10} {r['step_s']:>8.4f} {r['mean_step_s']:>8.4f} {hit:>8} "
              f"{r['disk_bytes_read_per_step'] / (1 << 20):>13.1f}")
    print(f"{g:<6} auto / best fixed step: {ra['auto_vs_best_fixed']:.3f} (median), "
          f"{ra['auto_vs_best_fixed_mean']:.3f} (mean) (cache of {ra['cache_units']} "
          f"of {ra['units']} units, {ra['rounds']} rounds); one setting in two engines differs by "
          f"{100 * ra['same_setting_spread']:.0f}%")


def _workers(name: str) -> int:
    return int(name.split()[0])


def specs(args) -> Spec:
    if args.smoke:
        return Spec("wan-smoke", "wan", dim=64, heads=4, tokens=16, ctx=8, blocks=8, ffn=128)
    return Spec("wan-disk", "wan", dim=args.dim, heads=max(1, args.dim // 128), tokens=args.tokens, ctx=16,
                blocks=args.blocks, ffn=args.ffn)


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(result: dict) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  file {result['file_bytes'] / MIB:.1f} MiB, "
          f"{result['spec']['blocks']} blocks; {result['settings']['cache_units']}-unit cache, "
          f"{result['settings']['workers']} reader(s), {result['settings']['granularity']}")
    if result["read_limit"]:
        print(f"disk reads held to {result['read_limit']['mib_s']} MiB/s ({result['read_limit']['how']})")
    head = (f"{'mode':<7} {'1st step s':>10} {'/ reads':>8} {'written MiB':>11} {'engine GiB/s':>12} "
            f"{'wall GiB/s':>10} {'direct GiB/s':>14} {'P8':>5} {'busy':>5} {'hits':>5} {'bits':>5}")
    print(head)
    print("-" * len(head))
    for mode, r in result["modes"].items():
        written = r["written_bytes_engine"] / MIB
        direct = f"{r['direct_read_before_gibps']:.2f}/{r['direct_read_after_gibps']:.2f}"
        hits = f"{100 * r['cache_hit_rate']:.0f}%" if r["cache_hit_rate"] is not None else "-"
        print(f"{mode:<7} {r['first_step_s']:>10.3f} {_f(r['first_step_vs_pass_reads'], '.2f'):>8} "
              f"{written:>11.1f} {_f(r['engine_read_gibps'], '.2f'):>12} {_f(r['wall_read_gibps'], '.2f'):>10} "
              f"{direct:>14} {_f(r['p8'], '.2f'):>5} {_f(r['engine_busy_share'], '.2f'):>5} {hits:>5} "
              f"{'same' if r['matches_reference'] else 'DIFF':>5}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, a few seconds")
    ap.add_argument("--dim", type=int, default=1536, help="1536 and FFN 4096: blocks of 60 MiB in bf16")
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16, help="few tokens: compute is trivial, the disk bounds")
    ap.add_argument("--granularity", default="block")
    ap.add_argument("--cache-units", type=int, default=6, help="host cache entries (units)")
    ap.add_argument("--workers", type=int, default=AUTO_READERS,
                    help=f"disk readers of the in-place and spill modes (default {AUTO_READERS}: the readers auto uses)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--passes", type=int, default=3, help="measured passes per mode")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", type=Path, default=None, help="folder for the model and spill files (default: a temp folder)")
    ap.add_argument("--drop-caches", action="store_true", help="also drop the whole page cache when cold (root)")
    ap.add_argument("--read-ahead-units", type=int, default=6,
                    help="cache size, in units, of the read-ahead comparison (1, 2, 4 workers and auto)")
    ap.add_argument("--read-ahead-rounds", type=int, default=8,
                    help="rounds of that comparison, each starting one setting later; 0 leaves it out")
    ap.add_argument("--read-limit-mib-s", type=int, default=None,
                    help="hold this run's disk reads to this rate (root; the kernel's block throttle): "
                         "step times then compare the settings, not the disk's drift")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/disk_stream-<device>-<time>.json)")
    args = ap.parse_args(argv)
    if args.read_ahead_rounds < 0:
        ap.error("--read-ahead-rounds must be 0 (no read-ahead comparison) or more")
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.passes = min(args.passes, 2)
        args.cache_units = min(args.cache_units, 4)
        args.read_ahead_rounds = min(args.read_ahead_rounds, 1)
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = specs(args)
    torch.manual_seed(0)
    blocks = build_blocks(spec, device=torch.device("cpu"), dtype=torch.bfloat16)
    read_limit = (limit_reads(args.dir or Path(tempfile.gettempdir()), args.read_limit_mib_s)
                  if args.read_limit_mib_s else None)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "disk_stream_model.safetensors"
        file_bytes = write_model(blocks, path)
        resident = Stack(spec, device, blocks=[b.to(device) for b in blocks])
        ref = _bits(resident())  # every block on the device: the reference
        del resident, blocks
        result = {
            "device": name, "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "spec": vars(spec), "file_bytes": file_bytes, "read_limit": read_limit, "modes": {},
        }
        for mode in args.modes.split(","):
            result["modes"][mode] = run_mode(mode, spec, device, path, ref, args)
        result["read_ahead"] = run_read_ahead(spec, device, path, args) if args.read_ahead_rounds else None
    print_table(result)
    if result["read_ahead"] is not None:
        print_read_ahead(result)
    write_result(result, "disk_stream", name, args)
    return result


if __name__ == "__main__":
    main()

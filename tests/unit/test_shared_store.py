"""The shared host store (offload_core/sharing/shared_store.py and its helpers): one copy of a model's
packed bytes per machine, across real processes, safe when they die or disagree.

In-process tests run two streamers (or masters) over two copies of one toy model; the others run
tests/unit/shared_store_probe.py as separate processes, killed with SIGKILL where a test says so.
Every output is compared bit for bit with the toy model's own forward before anything was packed.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from offload_core.host.pinned import HostStorage
from offload_core.sharing.shared_packing import HostShare, pack_host
from offload_core.sharing.shared_store import HEADER, SharedHostStore
from offload_core.sharing.store_folder import (
    DISK,
    SHARED_MEMORY,
    SUPPORTED,
    StoreFolder,
    StoreUnavailable,
    check_name,
    holders,
    user_folder_name,
)
from offload_core.blocks.phases import stream_units
from offload_core.sharing.store_key import StoreKey
from offload_core.layerwise.plan import StreamPlan
from offload_core.layerwise.streamer import LayerwiseStreamer
from offload_core.models.swap import ModuleSwap
from toy_models import ToyDiT, assert_restored, bits, inputs, snapshot

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="shared host stores need Linux")

PROBE = Path(__file__).resolve().parent / "shared_store_probe.py"


def _share(root: Path, source: str = "toy", disk: Path | None = None) -> HostShare:
    folders = [StoreFolder(str(root), SHARED_MEMORY)] + ([StoreFolder(str(disk), DISK)] if disk else [])
    return HostShare({"file": source}, tuple(folders))


def _files(root: Path) -> list[str]:
    folder = root / user_folder_name()
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _stores(root: Path) -> list[str]:
    return [n for n in _files(root) if n.endswith(".store")]


def _model(seed: int = 0) -> tuple[ToyDiT, torch.Tensor]:
    model = ToyDiT(depth=6, dim=64, seed=seed)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    return model, ref


def _run(model: ToyDiT) -> torch.Tensor:
    x, t = inputs()
    with torch.no_grad():
        return model(x, t)


# ---------------------------------------------------------------------- one process, two copies
def test_two_streamers_of_one_file_map_one_store_and_the_last_removes_it(tmp_path):
    share = _share(tmp_path)
    models, streamers, befores = [], [], []
    for _ in range(2):
        model, ref = _model()
        before, keys = snapshot(model), list(model.state_dict())
        s = LayerwiseStreamer(list(model.blocks), "cpu", resident=1, host_chunk_bytes=64 << 10, share=share)
        s.attach()
        assert torch.equal(bits(_run(model)), bits(ref))
        s.detach(keep_pack=True)
        assert torch.equal(bits(_run(model)), bits(ref))  # core's view: computing from the store's bytes
        models.append(model), streamers.append(s), befores.append((before, keys))
    first, second = (s.host_store() for s in streamers)
    assert first["shared"] and second["shared"] and first["file"] == second["file"]
    assert first["created_here"] and not second["created_here"]
    assert second["users"] == 2  # two open files hold it, as two processes would
    assert streamers[1].telemetry.blocks_packed == 0  # it mapped; it did not pack
    assert len(_stores(tmp_path)) == 1
    size = (tmp_path / user_folder_name() / first["file"]).stat().st_size
    assert size == first["bytes"] >= streamers[0].packed_bytes
    streamers[0].close()
    assert_restored(models[0], *befores[0])
    assert len(_stores(tmp_path)) == 1 and streamers[1].host_store()["users"] == 1
    streamers[1].close()
    assert_restored(models[1], *befores[1])
    assert _files(tmp_path) == []  # the last to let go removed the store and its lock file


def test_store_files_are_private_and_named_inside_their_folder(tmp_path):
    model, _ = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=_share(tmp_path))
    s.attach()
    folder = tmp_path / user_folder_name()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in _files(tmp_path):
        st = (folder / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), name
    s.close()
    for bad in ("../x", "a" * 31, "A" * 32, "0" * 32 + "/", "0" * 31 + "g", 7):
        with pytest.raises(ValueError):
            check_name(bad)


def test_a_folder_open_to_others_or_a_link_is_never_used(tmp_path):
    """A store folder that is not the user's own is refused, never read or written: the model is
    packed privately, with the reason (tests/unit/test_store_adversarial.py: another user's)."""
    open_root = tmp_path / "open"
    (open_root / user_folder_name()).mkdir(parents=True, mode=0o755)
    os.chmod(open_root / user_folder_name(), 0o755)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / user_folder_name()).symlink_to(tmp_path, target_is_directory=True)
    for root, why in ((open_root, "not this user's own folder.*mode 755"), (linked, "is not a folder")):
        model, ref = _model()
        s = LayerwiseStreamer(list(model.blocks), "cpu", share=_share(root))
        s.attach()
        store = s.host_store()
        assert not store["shared"] and re.search(why, store["why"]), store
        assert torch.equal(bits(_run(model)), bits(ref))
        s.close()
        assert torch.equal(bits(_run(model)), bits(ref))
    assert os.listdir(open_root / user_folder_name()) == []
    assert sorted(os.listdir(tmp_path)) == ["linked", "open"]  # nothing written through the link


def test_a_store_without_its_completion_mark_is_never_mapped(tmp_path):
    model, _ = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", host_chunk_bytes=64 << 10, share=_share(tmp_path))
    s.attach()
    s.detach(keep_pack=True)
    name = s.host_store()["file"]
    path = tmp_path / user_folder_name() / name
    # A store whose mark is gone while a process holds it (what a writer cut short would leave,
    # were it ever under the final name): another process refuses it and keeps a private copy.
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, b"\0" * 8, 8)
    os.close(fd)
    other, ref2 = _model()
    s2 = LayerwiseStreamer(list(other.blocks), "cpu", host_chunk_bytes=64 << 10, share=_share(tmp_path))
    s2.attach()
    store = s2.host_store()
    assert store == {"shared": False, "why": f"{path} is not a complete store"}
    assert torch.equal(bits(_run(other)), bits(ref2))
    s2.close()
    s.close()
    assert _files(tmp_path) == []


def test_a_store_no_live_process_holds_is_removed_and_packed_again(tmp_path):
    model, _ = _model()
    share = _share(tmp_path)
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=share)
    s.attach()
    path = tmp_path / user_folder_name() / s.host_store()["file"]
    left = path.read_bytes()
    s.close()
    # What a killed process leaves: the complete file, no holder.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, left)
    os.close(fd)
    other, ref = _model()
    s2 = LayerwiseStreamer(list(other.blocks), "cpu", share=share)
    s2.attach()
    assert s2.host_store()["created_here"]  # never reused: removed and written again
    assert torch.equal(bits(_run(other)), bits(ref))
    s2.close()
    assert _files(tmp_path) == []


def test_processes_that_disagree_on_the_values_never_share(tmp_path):
    share = _share(tmp_path)
    model, ref = _model(seed=0)
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=share)
    s.attach()
    other, ref2 = _model(seed=1)  # the same layout under the same key, other values
    s2 = LayerwiseStreamer(list(other.blocks), "cpu", share=share)
    s2.attach()
    why = s2.host_store()
    assert not why["shared"] and "holds other bytes than this process loaded" in why["why"]
    assert torch.equal(bits(_run(other)), bits(ref2)) and torch.equal(bits(_run(model)), bits(ref))
    s2.close()
    s.close()


def test_one_element_that_differs_is_enough_to_never_share(tmp_path):
    """A model equal to the store's but for one element in the middle of one tensor packs
    privately, and that store is not joined again by this process."""
    share = _share(tmp_path)
    model, ref = _model(seed=0)
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=share)
    s.attach()
    for attempt in range(2):
        other, _ = _model(seed=0)
        with torch.no_grad():
            w = other.blocks[1].mlp_out.weight
            w.view(-1)[w.numel() // 2 + 7] += 1
            want = _run(other)
        s2 = LayerwiseStreamer(list(other.blocks), "cpu", share=share)
        s2.attach()
        why = s2.host_store()
        assert not why["shared"] and "not joined again" in why["why"], why
        assert ("differed from this process's weights before" if attempt else "block 1: mlp_out.weight") in why["why"]
        assert torch.equal(bits(_run(other)), bits(want))
        s2.close()
    assert torch.equal(bits(_run(model)), bits(ref))
    s.close()


def test_bytes_flipped_in_a_complete_store_are_never_used(tmp_path):
    share = _share(tmp_path)
    model, ref = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=share)
    s.attach()
    s.detach(keep_pack=True)
    path = tmp_path / user_folder_name() / s.host_store()["file"]
    with open(path, "r+b") as f:  # as a stray write or a bad page would
        f.seek(HEADER + 3 * 4096 + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    other, want = _model()
    s2 = LayerwiseStreamer(list(other.blocks), "cpu", share=share)
    s2.attach()
    assert not s2.host_store()["shared"]
    assert torch.equal(bits(_run(other)), bits(want))
    s2.close()
    s.close()


def test_a_write_in_place_after_detach_stays_this_process_own(tmp_path):
    """What the pack hands back shows a copy-on-write mapping of the store: an in-place write (a
    hook LoRA's ``copy_to_param``, an ``add_()``) neither kills the process nor reaches the store
    or the other process, and the next attach streams the written values."""
    share = _share(tmp_path)
    model, _ = _model()
    keys = list(model.state_dict())
    s = LayerwiseStreamer(list(model.blocks), "cpu", resident=1, share=share)
    s.attach()
    s.detach(keep_pack=True)
    twin, ref = _model()
    s2 = LayerwiseStreamer(list(twin.blocks), "cpu", resident=1, share=share)
    s2.attach()
    assert s2.host_store()["shared"]
    path = tmp_path / user_folder_name() / s.host_store()["file"]
    before = path.read_bytes()
    with torch.no_grad():
        for b in model.blocks:
            b.mlp_out.weight.add_(0.25)
        want = _run(model)  # core's own run of the written weights, without the engine
    assert path.read_bytes() == before
    assert torch.equal(bits(_run(twin)), bits(ref))  # the other streamer still runs the store
    s.attach()  # the written blocks no longer match the store: packed again, privately
    assert torch.equal(bits(_run(model)), bits(want))
    assert not s.host_store()["shared"]
    s.close()
    assert torch.equal(bits(_run(model)), bits(want))
    s2.close()
    assert sorted(model.state_dict()) == sorted(keys)


def test_a_merge_rewrites_device_copies_never_the_shared_bytes(tmp_path):
    """A LoRA-like transform per streamer: each gets its own merged result from one store."""
    share = _share(tmp_path)
    model, _ = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", resident=2, share=share)
    s.attach()
    s.detach(keep_pack=True)
    path = tmp_path / user_folder_name() / s.host_store()["file"]
    before = path.read_bytes()
    outs = {}
    for scale in (1.5, 0.5):
        merged, _ = _model()
        with torch.no_grad():
            for b in merged.blocks:
                b.mlp_out.weight.mul_(scale)
            want = _run(merged)
        twin, _ = _model()
        st = LayerwiseStreamer(list(twin.blocks), "cpu", resident=2, share=share)

        def lora(block, name, view, scale=scale):
            return view * scale if name.endswith("mlp_out.weight") else view

        st.attach(transform=lora)
        assert st.host_store()["users"] == 2
        outs[scale] = _run(twin)
        assert torch.equal(bits(outs[scale]), bits(want)), scale
        st.close()
    assert path.read_bytes() == before
    s.close()


@pytest.mark.parametrize("device", ["model"])
def test_the_store_is_page_locked_read_only_and_nothing_writes_it(tmp_path, device, stream_model):
    """Under the stream model (the GPU path on a CPU: pinned packs, a copy stream, merges on
    device copies), the store's chunks are registered read-only and no write ever reaches them."""
    share = _share(tmp_path)
    model, ref = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", resident=1, host_chunk_bytes=64 << 10, share=share)
    s.attach(transform=lambda block, name, view: view * 1.0 if name.endswith("qkv.weight") else view)
    assert s.host_bytes()["pinned"] > 0
    assert torch.equal(bits(_run(model)), bits(ref))
    s.detach(keep_pack=True)
    assert any(b.read_only for b in stream_model._buffers.values())
    s.close()


def test_module_swap_shares_its_master_and_leaves_a_kept_pack_alone(tmp_path):
    share = _share(tmp_path)
    masters, models = [], []
    for _ in range(2):
        model, ref = _model()
        masters.append(ModuleSwap(model, pin=False, part_bytes=64 << 10, share=share))
        models.append((model, ref))
        assert torch.equal(bits(_run(model)), bits(ref))  # core computes from the (read-only) master
    assert masters[1].host_store()["users"] == 2 and len(_stores(tmp_path)) == 1
    for m in masters:
        m.close()
    assert _files(tmp_path) == []
    # A model whose blocks live in a layerwise streamer's kept pack: the master holds the rest.
    model, ref = _model()
    before, keys = snapshot(model), list(model.state_dict())
    s = LayerwiseStreamer(list(model.blocks), "cpu")
    s.attach()
    s.detach(keep_pack=True)
    swap = ModuleSwap(model, pin=False, skip=s.shows_kept_pack)
    assert swap.skipped > 0 and swap.nbytes < s.packed_bytes / 4  # the master holds what is not in blocks
    assert all(s.shows_kept_pack(t) for b in model.blocks for t in b.parameters())
    assert torch.equal(bits(_run(model)), bits(ref))
    swap.close()
    s.close()
    assert_restored(model, before, keys)


def test_a_store_whose_first_chunk_holds_only_empty_items(tmp_path):
    """An empty first item alone in its chunk (the next is larger than a chunk): nothing to map."""
    folder = StoreFolder(str(tmp_path), SHARED_MEMORY)
    store = SharedHostStore.open(folder, lambda spans: StoreKey({"a": 2}, [spans]), [0, 8192], pin=False,
                                 ram_budget_bytes=None, chunk_bytes=4096, label="t")
    assert store.storage.chunk_spans == [0, 8192]
    assert store.writable(0).numel() == 0
    store.written(0)
    store.writable(1).fill_(3)
    store.written(1)
    store.finish()
    assert store.storage.buffer(0).numel() == 0 and int(store.storage.buffer(1).sum()) == 3 * 8192
    store.release()
    assert _files(tmp_path) == []


def test_host_storage_knows_which_tensors_live_in_it():
    storage = HostStorage([64, 4096], pin=False)
    buf = storage.buffer(1)
    assert storage.holds(buf[8:16]) and not storage.holds(torch.zeros(4))
    storage.release()


def test_the_key_names_what_makes_the_bytes():
    a = StoreKey({"file": "x", "version": [1]}, [[1, 2]])
    assert a.digest == StoreKey({"version": [1], "file": "x"}, [[1, 2]]).digest  # canonical
    assert a.digest != StoreKey({"file": "x", "version": [2]}, [[1, 2]]).digest  # a changed file
    assert a.digest != StoreKey({"file": "x", "version": [1]}, [[1, 3]]).digest  # another layout


# ------------------------------------------------------------------------- separate processes
class Probe:
    """tests/unit/shared_store_probe.py as a process, its JSON events read as they come."""

    def __init__(self, root: Path, *args: str, env: dict | None = None, preexec=None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PROBE), str(root), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                                     preexec_fn=preexec)
        self.events: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "exit"})
            self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                    if e["event"] == "exit":
                        raise AssertionError(f"the probe ended: {self.proc.stderr.read()[-3000:]}")
                left = deadline - time.monotonic()
                assert left > 0, f"no such event after {timeout} s: {self.events[-3:]}"
                self._cond.wait(left)

    def ready(self) -> dict:
        return self.wait_for(lambda e: e["event"] == "ready")

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.wait_for(lambda e: e["event"] == "closed")
        assert self.proc.wait(60) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _pss_of(pid: int, name: str) -> int:
    """Proportional set size (bytes) of the process's mappings of the file ``name``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(name)
            elif inside and head[0] == "Pss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc (Linux)")
def test_processes_share_one_copy_and_a_killed_one_lets_go(tmp_path):
    probes = []
    try:
        probes = [Probe(tmp_path, "--hold") for _ in range(2)]
        events = [p.ready() for p in probes]
        for e in events:
            assert e["out"] == e["kept"] == e["ref"], e
            assert e["store"]["shared"], e
        assert sum(e["store"]["created_here"] for e in events) == 1  # one packed, the other mapped
        name = events[0]["store"]["file"]
        assert _stores(tmp_path) == [name]
        size = events[0]["store"]["bytes"]
        pss = sum(_pss_of(e["pid"], name) for e in events)
        assert size - HEADER - 2 * 4096 <= pss <= size, (pss, size)  # one copy for the machine
        probes[0].kill()  # mid-life, as a crashed worker
        assert _stores(tmp_path) == [name]  # the other holds it
        probes[1].close()
        assert _files(tmp_path) == []  # the last to let go removed it, although one holder died
    finally:
        for p in probes:
            p.stop()


def test_a_packer_killed_mid_pack_leaves_nothing_read_as_complete(tmp_path):
    """Others wait for a process that packs the store they need (an interrupt ends the wait with
    the model whole); once it is killed mid-pack, one of them packs the store itself, and its part
    file is never read."""
    packer = Probe(tmp_path, "--pause-at", "2", "--hold")
    waiter = None
    try:
        packer.wait_for(lambda e: e["event"] == "paused")
        model, ref = _model()  # the probes' model: the same key
        before, keys = snapshot(model), list(model.state_dict())
        s = LayerwiseStreamer(list(model.blocks), "cpu", resident=1, host_chunk_bytes=64 << 10,
                              share=_share(tmp_path))

        class Interrupted(Exception):
            pass

        def interrupt(done, total):
            if done == 0:  # waiting: ComfyUI's progress hook raises on an interrupt
                raise Interrupted
        with pytest.raises(Interrupted):
            s.attach(progress=interrupt)
        assert_restored(model, before, keys)
        waiter = Probe(tmp_path, "--hold")
        waiter.wait_for(lambda e: e["event"] == "packing" and e["done"] == 0)  # waiting for the lock
        assert _stores(tmp_path) == [] and [n for n in _files(tmp_path) if n.endswith(".part")]
        packer.kill()
        e = waiter.ready()
        assert e["out"] == e["kept"] == e["ref"] and e["store"]["created_here"]  # it packed itself
        assert not [n for n in _files(tmp_path) if n.endswith(".part")]  # the dead packer's part is gone
        s.attach()  # now it maps what the waiter packed
        assert not s.host_store()["created_here"] and torch.equal(bits(_run(model)), bits(ref))
        s.close()
        waiter.close()
        assert _files(tmp_path) == []
    finally:
        packer.stop()
        if waiter is not None:
            waiter.stop()


def test_stores_left_by_ended_processes_are_swept(tmp_path):
    model, _ = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=_share(tmp_path))
    s.attach()
    path = tmp_path / user_folder_name() / s.host_store()["file"]
    left = path.read_bytes()
    s.close()
    for name in (path.name, path.name.replace(".store", ".4242.part")):  # a store and a packer's part
        fd = os.open(path.parent / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, left)
        os.close(fd)
    held = tmp_path / user_folder_name() / ("f" * 32 + ".store")  # a store a live process holds
    held.write_bytes(b"x")
    held.chmod(0o600)
    import fcntl
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    removed = StoreFolder(str(tmp_path), SHARED_MEMORY).sweep()
    assert len(removed) == 2 and _stores(tmp_path) == [held.name]  # (with the lock file it took)
    assert not [n for n in _files(tmp_path) if n.endswith(".part")]
    os.close(fd)
    assert StoreFolder(str(tmp_path), SHARED_MEMORY).sweep() and _files(tmp_path) == []


def _file_limit(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.mark.parametrize("limit", [0, 150 << 10], ids=["at-creation", "mid-pack"])
def test_a_folder_without_room_falls_back_and_loses_nothing(tmp_path, limit):
    """A folder that refuses to grow the file (a full tmpfs fails the same allocation): the next
    folder (a disk folder), else a private copy; the output is right either way."""
    disk = tmp_path / "disk"
    disk.mkdir()
    p = Probe(tmp_path, "--disk", str(disk), "--hold", preexec=_file_limit(limit))
    try:
        e = p.ready()
        assert e["out"] == e["kept"] == e["ref"]
        # The disk folder is under the same limit, so the store ends up private, with the reason:
        # refused at once, or after some blocks were packed into (and taken from) the store.
        why = "refused a new store" if limit == 0 else "ran out of room while the store was written"
        assert not e["store"]["shared"] and why in e["store"]["why"], e
        assert not [n for n in _files(tmp_path) + _files(disk) if n.endswith((".part", ".store"))]
        p.close()
    finally:
        p.stop()
    assert _files(tmp_path) == [] or all(n.endswith(".lock") for n in _files(tmp_path))


def test_no_room_in_shared_memory_uses_the_disk_folder(tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    monkeypatch.setattr(StoreFolder, "free_bytes",
                        lambda self: 0 if self.kind == SHARED_MEMORY else 1 << 40)
    model, ref = _model()
    s = LayerwiseStreamer(list(model.blocks), "cpu", share=_share(tmp_path, disk=disk))
    s.attach()
    store = s.host_store()
    assert store["shared"] and store["kind"] == DISK and store["folder"] == str(disk / user_folder_name())
    assert torch.equal(bits(_run(model)), bits(ref))
    s.close()


def test_holders_counts_each_open_file_that_holds_it(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    import fcntl
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_SH)
    assert holders(fds[0]) == 3
    os.close(fds.pop())
    assert holders(fds[0]) == 2
    for fd in fds:
        os.close(fd)


def test_open_refuses_a_store_of_the_same_name_with_another_key(tmp_path):
    folder = StoreFolder(str(tmp_path), SHARED_MEMORY)
    store = SharedHostStore.open(folder, lambda spans: StoreKey({"a": 1}, [spans]), [4096], pin=False,
                                 ram_budget_bytes=None, chunk_bytes=1 << 20, label="t")
    store.writable(0).fill_(7)
    store.written(0)
    store.finish()
    name = store.key.digest

    class Other(StoreKey):  # a key whose name clashes with the store's: the header tells them apart
        @property
        def full_digest(self) -> str:
            return "0" * 64

        @property
        def digest(self) -> str:
            return name

    with pytest.raises(StoreUnavailable, match="another format or key"):
        SharedHostStore.open(folder, lambda spans: Other({"a": 1}, [spans]), [4096], pin=False,
                             ram_budget_bytes=None, chunk_bytes=1 << 20, label="t")
    assert torch.equal(store.storage.buffer(0), torch.full((4096,), 7, dtype=torch.uint8))
    store.release()
    assert _files(tmp_path) == []


def test_pack_host_without_a_share_is_private(tmp_path):
    model, ref = _model()
    plan = StreamPlan(list(model.blocks), stream_units(list(model.blocks), "block"), "block", resident=None,
                      vram_budget_bytes=None, prefetch=1)
    packed = pack_host(plan.all_packs(), pin=False, ram_budget_bytes=None, chunk_bytes=1 << 20,
                       label="t", share=None)
    assert packed.store is None and packed.status() == {"shared": False, "why": None}
    assert torch.equal(bits(_run(model)), bits(ref))
    for p in plan.all_packs():
        p.restore(keep_host=False)
    packed.release()

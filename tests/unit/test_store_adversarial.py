"""The shared host store against what a machine can do to it: another local user who takes the
store folder's name first, files changed or swapped by someone else, a holder killed with
SIGKILL, a packer stopped with SIGSTOP, a fork without exec, a FIFO named like a store, a folder
removed while held, a full folder, a store larger than its share of the folder.

Sharing is an optimisation: in every case the model's output must be the toy model's own, bit
for bit (nothing lost), and where the store cannot be used the pack is private with the reason.
Processes are tests/unit/shared_store_probe.py, driven through its events (no sleeps).
"""
from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import threading

import pytest
import torch

from offload_core.sharing import store_folder
from offload_core.sharing.shared_packing import HostShare
from offload_core.sharing.store_folder import (
    DEFAULT_MAX_SHARE,
    SHARED_MEMORY,
    SUPPORTED,
    StoreFolder,
    max_share,
    user_folder_name,
)
from offload_core.layerwise.streamer import LayerwiseStreamer
from offload_core.units import size_text
from test_shared_store import Probe, _files, _model, _run, _share, _stores
from toy_models import assert_restored, bits, snapshot

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="shared host stores need Linux")
fcntl = pytest.importorskip("fcntl", reason="shared host stores need Linux")

NEIGHBOUR = "tiered-neighbour"


def _streamer(model, share: HostShare) -> LayerwiseStreamer:
    return LayerwiseStreamer(list(model.blocks), "cpu", resident=1, host_chunk_bytes=64 << 10, share=share)


def _pack_privately(share: HostShare, why: str) -> None:
    """A model packed with ``share`` runs right, privately, with ``why`` in the reason."""
    model, ref = _model()
    before, keys = snapshot(model), list(model.state_dict())
    s = _streamer(model, share)
    s.attach()
    store = s.host_store()
    assert not store["shared"] and why in store["why"], store
    assert torch.equal(bits(_run(model)), bits(ref))
    s.close()
    assert_restored(model, before, keys)


def _store_name(root) -> str:
    """The store file name the toy model (seed 0, source "toy") gets, found by packing it once."""
    model, _ = _model()
    s = _streamer(model, _share(root))
    s.attach()
    name = s.host_store()["file"]
    s.close()
    assert _files(root) == []
    return name


def _neighbour_uid() -> int:
    """Another local user's uid: made with useradd when missing (only root runs this)."""
    try:
        return pwd.getpwnam(NEIGHBOUR).pw_uid
    except KeyError:
        pass
    if shutil.which("useradd") is not None:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", NEIGHBOUR], check=True,
                       capture_output=True)
        return pwd.getpwnam(NEIGHBOUR).pw_uid
    return 54321  # no user database to add to: an owner no process of ours runs as is enough


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a folder another user's")
@pytest.mark.parametrize("what", ["private-folder", "open-folder", "symlink"])
def test_another_user_who_takes_the_folder_name_first_gives_a_private_copy(tmp_path, what):
    """/dev/shm is open to every local user: a neighbour who makes ``tiered-offload-<our uid>``
    first (their own folder, one open to all, or a link to a folder of theirs) must not fail our
    prompts, and nothing of ours may be written into what they made."""
    uid = _neighbour_uid()
    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, uid, uid)
    taken = root / user_folder_name()
    if what == "symlink":
        taken.symlink_to(theirs, target_is_directory=True)
        os.lchown(taken, uid, uid)
        why = "is not a folder (a link or a file)"
    else:
        taken.mkdir(mode=0o700)
        os.chmod(taken, 0o700 if what == "private-folder" else 0o777)
        os.chown(taken, uid, uid)
        why = f"owner uid {uid}"
    for _ in range(2):  # every prompt: private, never an error
        _pack_privately(_share(root), why)
    assert os.listdir(theirs) == [] and (what == "symlink" or os.listdir(taken) == [])
    assert StoreFolder(str(root), SHARED_MEMORY).sweep() == []  # the sweep leaves it alone too


def test_a_store_or_lock_file_whose_mode_changed_gives_a_private_copy(tmp_path):
    """A store file (or its lock file) that someone made readable to others is no longer the
    user's private file: a process that would join it keeps a private copy instead of failing,
    and the holder still lets go of it (the last one removes it)."""
    share = _share(tmp_path)
    model, ref = _model()
    holder = _streamer(model, share)
    holder.attach()
    folder = tmp_path / user_folder_name()
    store = folder / holder.host_store()["file"]
    lock = store.with_suffix(".lock")
    os.chmod(store, 0o644)
    _pack_privately(share, "is not a private file of this user (a file, owner uid")
    os.chmod(store, 0o600)
    os.chmod(lock, 0o666)
    _pack_privately(share, f"the lock file {lock.name} is not a private file of this user")
    os.chmod(lock, 0o600)
    model2, ref2 = _model()
    joiner = _streamer(model2, share)
    joiner.attach()
    assert joiner.host_store()["shared"] and not joiner.host_store()["created_here"]
    assert torch.equal(bits(_run(model2)), bits(ref2)) and torch.equal(bits(_run(model)), bits(ref))
    joiner.close()
    holder.close()
    assert _files(tmp_path) == []


def test_a_store_whose_last_holder_was_killed_goes_at_the_next_pack(tmp_path, monkeypatch):
    """SIGKILL of the only process holding a store: the next pack of any model in that folder
    (here another model's, so it is the sweep that removes it, not a join) reclaims it."""
    monkeypatch.setattr(store_folder, "_last_sweep", {})
    probe = Probe(tmp_path, "--source", "killed", "--hold")
    try:
        e = probe.ready()
        assert e["out"] == e["kept"] == e["ref"] and e["store"]["shared"], e
        assert _stores(tmp_path) == [e["store"]["file"]]
        probe.kill()
    finally:
        probe.stop()
    assert _stores(tmp_path) == [e["store"]["file"]]  # no holder left, and no one has looked yet
    model, ref = _model(seed=1)
    s = _streamer(model, _share(tmp_path, source="other"))
    s.attach()
    assert s.host_store()["shared"] and _stores(tmp_path) == [s.host_store()["file"]]
    assert torch.equal(bits(_run(model)), bits(ref))
    s.close()
    assert _files(tmp_path) == []


def test_the_sweep_at_each_pack_looks_at_most_once_a_period(tmp_path, monkeypatch):
    monkeypatch.setattr(store_folder, "_last_sweep", {})
    monkeypatch.setattr(store_folder, "SWEEP_EVERY_S", 1e9)
    folder = StoreFolder(str(tmp_path), SHARED_MEMORY)
    assert folder.sweep_if_due() == []  # nothing there yet: the period starts
    (tmp_path / user_folder_name()).mkdir(mode=0o700)
    left = tmp_path / user_folder_name() / ("a" * 32 + ".store")
    left.write_bytes(b"x")
    left.chmod(0o600)
    assert folder.sweep_if_due() == [] and left.exists()  # within the period: not looked at
    monkeypatch.setattr(store_folder, "SWEEP_EVERY_S", 0.0)
    assert folder.sweep_if_due() == [f"{left.name} ({size_text(1)})"] and _files(tmp_path) == []


def test_a_stopped_packer_is_waited_for_only_so_long(tmp_path):
    """A packer stopped (SIGSTOP) while it holds the store's lock: a process that needs the same
    store waits only until the bound (shortened here) passes without a byte written, then packs
    privately. The packer, continued, publishes the store; both outputs are right."""
    packer = Probe(tmp_path, "--pause-at", "2", "--hold")
    waiter = None
    try:
        packer.wait_for(lambda e: e["event"] == "paused")
        packer.proc.send_signal(signal.SIGSTOP)
        waiter = Probe(tmp_path, "--hold", "--wait-bound", "0.5")
        w = waiter.ready()
        assert w["out"] == w["kept"] == w["ref"], w
        assert not w["store"]["shared"] and "lock for" in w["store"]["why"] \
            and "without writing to it" in w["store"]["why"], w
        packer.proc.send_signal(signal.SIGCONT)
        packer.proc.stdin.write("\n")  # ends the pause
        packer.proc.stdin.flush()
        p = packer.ready()
        assert p["out"] == p["kept"] == p["ref"] and p["store"]["shared"] and p["store"]["created_here"], p
        waiter.close()
        packer.close()
    finally:
        if packer.proc.poll() is None:
            packer.proc.send_signal(signal.SIGCONT)
        packer.stop()
        if waiter is not None:
            waiter.stop()
    assert _files(tmp_path) == []


def test_letting_go_while_a_stopped_process_holds_the_lock_neither_hangs_nor_raises(tmp_path, monkeypatch,
                                                                                     caplog):
    share = _share(tmp_path)
    model, ref = _model()
    before, keys = snapshot(model), list(model.state_dict())
    s = _streamer(model, share)
    s.attach()
    store = tmp_path / user_folder_name() / s.host_store()["file"]
    other = os.open(store.with_suffix(".lock"), os.O_RDWR)  # as a stopped process would hold it
    fcntl.flock(other, fcntl.LOCK_EX)
    monkeypatch.setattr(store_folder, "LET_GO_WAIT_S", 0.2)
    with caplog.at_level(logging.WARNING):
        s.close()
    assert_restored(model, before, keys)
    assert torch.equal(bits(_run(model)), bits(ref))
    assert [r for r in caplog.records if "let go without removing it" in r.getMessage()]
    assert store.exists()  # left for a sweep: no one holds it now
    os.close(other)
    assert StoreFolder(str(tmp_path), SHARED_MEMORY).sweep() and _files(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc (Linux)")
def test_a_child_forked_without_exec_does_not_keep_the_store(tmp_path):
    """A process that maps a store forks (no exec), then is killed: its child, still alive,
    shares its parent's open files but must not keep the store held, so the next sweep removes
    it. The child still reads exactly what the parent had, pages it wrote in place included."""
    probe = Probe(tmp_path, "--fork", "--hold")
    try:
        e = probe.ready()
        assert e["out"] == e["kept"] == e["ref"] and e["store"]["shared"], e
        parent_view = probe.wait_for(lambda e: e["event"] == "weights")["sha"]
        child = probe.wait_for(lambda e: e["event"] == "forked")
        assert child["sha"] == parent_view  # the child's mappings read what the parent's did
        probe.kill()  # the parent: the child lives on
        os.kill(child["pid"], 0)
        assert StoreFolder(str(tmp_path), SHARED_MEMORY).sweep() == [f"{e['store']['file']} "
                                                                    f"({size_text(e['store']['bytes'])})"]
        assert _files(tmp_path) == []
        probe.proc.stdin.write("\n")  # the child ends
        probe.proc.stdin.flush()
        probe.wait_for(lambda e: e["event"] == "exit")  # its stdout (the parent's) is closed
    finally:
        probe.stop()


def test_a_fifo_named_like_a_store_neither_hangs_nor_fails(tmp_path):
    """Opening a FIFO blocks until a writer comes: one named like a store, a lock or a part file
    must be refused before anything reads it, at a pack (private copy) and at a sweep (left
    alone); it never hangs the process."""
    name = _store_name(tmp_path)
    digest = name.removesuffix(".store")
    folder = tmp_path / user_folder_name()
    fifo = folder / name
    os.mkfifo(fifo, 0o600)
    probe = Probe(tmp_path, "--hold")  # a hang would end as no "ready" event (wait_for's bound)
    try:
        e = probe.ready()
        assert e["out"] == e["kept"] == e["ref"], e
        assert not e["store"]["shared"] and "a FIFO" in e["store"]["why"], e
        probe.close()
    finally:
        probe.stop()
    swept: list = []
    t = threading.Thread(target=lambda: swept.append(StoreFolder(str(tmp_path), SHARED_MEMORY).sweep()),
                         daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and swept == [[]] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    os.unlink(fifo)
    lock = folder / f"{digest}.lock"
    lock.unlink(missing_ok=True)  # the private packs' lock file: the FIFO takes its name
    os.mkfifo(lock, 0o600)
    _pack_privately(_share(tmp_path), "a FIFO")
    os.unlink(lock)
    os.mkfifo(folder / f"{digest}.999.part", 0o600)  # a dead packer's part: removed, then packed
    model, ref = _model()
    s = _streamer(model, _share(tmp_path))
    s.attach()
    assert s.host_store()["shared"] and s.host_store()["created_here"]
    assert torch.equal(bits(_run(model)), bits(ref))
    s.close()
    assert _files(tmp_path) == []


@pytest.mark.parametrize("removed", ["folder", "files"])
def test_a_folder_removed_while_held_lets_go_quietly(tmp_path, removed, caplog):
    """A logout with RemoveIPC (or a person) removes the store folder, or its files, while a
    process maps a store: letting go neither raises nor loses a value, and logs one line."""
    share = _share(tmp_path)
    model, ref = _model()
    before, keys = snapshot(model), list(model.state_dict())
    s = _streamer(model, share)
    s.attach()
    s.detach(keep_pack=True)
    folder = tmp_path / user_folder_name()
    if removed == "folder":
        shutil.rmtree(folder)
    else:
        for name in os.listdir(folder):
            os.unlink(folder / name)
    assert torch.equal(bits(_run(model)), bits(ref))  # the mapping outlives the name
    with caplog.at_level(logging.INFO):
        s.close()
    assert_restored(model, before, keys)
    assert torch.equal(bits(_run(model)), bits(ref))
    lines = [r for r in caplog.records if r.name.endswith("shared_store") and r.levelno >= logging.INFO]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert _files(tmp_path) == []
    s2 = _streamer(model, share)  # and the folder is made again for the next pack
    s2.attach()
    assert s2.host_store()["shared"] and torch.equal(bits(_run(model)), bits(ref))
    s2.close()
    assert _files(tmp_path) == []


def _mount_tmpfs(where, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def test_a_full_shared_memory_folder_gives_a_private_copy(tmp_path):
    """A real tmpfs that another file already fills: the store does not fit (refused at once),
    and a store that fits at first but not once written (the folder filled meanwhile) loses
    nothing either."""
    shm = tmp_path / "shm"
    _mount_tmpfs(shm, "256k")
    try:
        filler = shm / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (200 << 10))
        _pack_privately(_share(shm), "free and the store needs")
        os.unlink(filler)
        model, ref = _model()
        s = _streamer(model, _share(shm))
        real_free = StoreFolder.free_bytes
        with pytest.MonkeyPatch.context() as mp:  # the check passes, the writes then find no room
            mp.setattr(StoreFolder, "free_bytes", lambda self: 1 << 40)
            with open(filler, "wb") as f:
                f.write(b"\0" * (200 << 10))
            s.attach()
        assert real_free(StoreFolder(str(shm), SHARED_MEMORY)) < (100 << 10)
        store = s.host_store()
        assert not store["shared"] and "room" in store["why"], store
        assert torch.equal(bits(_run(model)), bits(ref))
        s.close()
        assert not [n for n in _files(shm) if n.endswith((".part", ".store"))]
    finally:
        subprocess.run(["umount", str(shm)], check=True)


def test_a_store_larger_than_its_share_of_the_folder_is_private(tmp_path):
    """``max_share``: one store takes at most that fraction of the folder's size; a larger one
    is private with the reason, a smaller one is shared."""
    total = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    tight = StoreFolder(str(tmp_path), SHARED_MEMORY, max_share=(64 << 10) / total)
    _pack_privately(HostShare({"file": "toy"}, (tight,)), "one store may take")
    assert _files(tmp_path) == []
    model, ref = _model()
    s = _streamer(model, HostShare({"file": "toy"}, (StoreFolder(str(tmp_path), SHARED_MEMORY, max_share=1.0),)))
    s.attach()
    assert s.host_store()["shared"] and torch.equal(bits(_run(model)), bits(ref))
    s.close()
    assert _files(tmp_path) == []


@pytest.mark.parametrize("value,want", [(0.25, 0.25), (1, 1.0), (0, 0.0), (-0.1, DEFAULT_MAX_SHARE),
                                        (1.5, DEFAULT_MAX_SHARE), (float("nan"), DEFAULT_MAX_SHARE),
                                        ("0.3", DEFAULT_MAX_SHARE), (True, DEFAULT_MAX_SHARE),
                                        (None, DEFAULT_MAX_SHARE)])
def test_the_share_setting_is_checked(value, want, caplog, monkeypatch):
    monkeypatch.setattr(store_folder, "_said", set())
    with caplog.at_level(logging.WARNING):
        assert max_share(value, '"shared_memory_max_share" in x.json') == want
    said = [r.getMessage() for r in caplog.records]
    if want == DEFAULT_MAX_SHARE and value != DEFAULT_MAX_SHARE:
        assert len(said) == 1 and "not a fraction from 0 to 1" in said[0] and "x.json" in said[0], said
    else:
        assert said == []

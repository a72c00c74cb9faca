"""A model file's identity (offload_core/files/file_identity.py): a change of its metadata alone
(chmod, chown, a new hard link) leaves it the same file where its bytes read back as witnessed;
a write whose modification time was put back, and another file renamed over the name, do not.
Both ways the bytes are witnessed are covered: the whole file (a shared host copy) and the
ranges disk streaming read in place (``ModelFile``)."""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from offload_core.disk.in_place import ModelFile, ModelFileChanged, plan_read
from offload_core.files import file_identity
from offload_core.files.file_identity import content_may_differ, file_version, same_bytes, witness_whole

SIZE = 3 * 4096 + 123


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * (SIZE // 256) + b"\x07" * (SIZE % 256))
    return str(path)


def _tick() -> None:
    time.sleep(0.05)  # a coarse change-time clock must tick before the change (no timing is asserted)


def _witnessed(path: str) -> tuple[int, ...]:
    version = file_version(os.stat(path))
    witness_whole(path, version)
    file_identity._wait_for_digest(version)
    return version


def _chmod(path, tmp_path):
    os.chmod(path, 0o600)


def _chown(path, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(path, 12345, 12345)


def _hard_link(path, tmp_path):
    os.link(path, tmp_path / "another name.bin")


def _write_and_put_mtime_back(path, tmp_path):
    before = os.stat(path)
    with open(path, "r+b") as f:  # the same size, in place
        f.seek(4096 + 5)
        f.write(b"\xff")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _rename_over(path, tmp_path):
    before = os.stat(path)
    other = tmp_path / "same bytes.bin"
    with open(path, "rb") as f:
        other.write_bytes(f.read())
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(other, path)


METADATA_ONLY = [_chmod, _chown, _hard_link]
REFUSED = [_write_and_put_mtime_back, _rename_over]


@pytest.mark.parametrize("change", METADATA_ONLY, ids=lambda f: f.__name__.strip("_"))
def test_a_change_of_metadata_alone_keeps_a_witnessed_file_the_same(model_file, tmp_path, change, caplog):
    was = _witnessed(model_file)
    _tick()
    change(model_file, tmp_path)
    now = file_version(os.stat(model_file))
    assert now != was and not content_may_differ(was, now)
    with caplog.at_level(logging.INFO, logger=file_identity.__name__):
        assert same_bytes(model_file, was, whole=True) == now
        assert same_bytes(model_file, was, whole=True) == now  # remembered: said (and read) once
    said = [r.getMessage() for r in caplog.records if "bytes are unchanged" in r.getMessage()]
    assert said == [f"[tiered offload] metadata of {model_file} changed (mode/owner/links); its bytes are "
                    f"unchanged (checked)"]


@pytest.mark.parametrize("change", REFUSED, ids=lambda f: f.__name__.strip("_"))
def test_other_bytes_under_the_name_are_refused_even_with_the_times_put_back(model_file, tmp_path, change):
    was = _witnessed(model_file)
    _tick()
    change(model_file, tmp_path)
    assert file_version(os.stat(model_file))[3] == was[3]  # the modification time is the old one
    assert same_bytes(model_file, was, whole=True) is None


def test_a_file_not_witnessed_is_refused_on_any_change(model_file, tmp_path):
    """Nothing to compare with (the digest was never taken): the check never guesses."""
    was = file_version(os.stat(model_file))
    _tick()
    _chmod(model_file, tmp_path)
    assert same_bytes(model_file, was) is None
    assert same_bytes(model_file, file_version(os.stat(model_file))) is not None  # unchanged since then


def _read_all(file: ModelFile) -> torch.Tensor:
    plan = plan_read([(0, SIZE, 0)])
    buf = torch.empty(plan.buffer_bytes + 4096, dtype=torch.uint8)
    at = (-buf.data_ptr()) % 4096
    dst = buf[at: at + plan.buffer_bytes]
    file.read(plan, dst)
    return dst[:SIZE].clone()


def test_disk_streaming_runs_on_after_a_chmod_of_the_file_it_reads_in_place(model_file, tmp_path):
    file = ModelFile(model_file)
    try:
        first = _read_all(file)  # each range is witnessed at its first read
        opened = file.version
        _tick()
        _chmod(model_file, tmp_path)
        file.check()
        file.check(opened)  # a released tensor's slice names the version it was read at
        assert torch.equal(_read_all(file), first)
    finally:
        file.close()
    ModelFile(model_file, opened).close()  # a later engine opens it for those slices


def test_disk_streaming_fails_on_a_write_with_the_modification_time_put_back(model_file, tmp_path):
    file = ModelFile(model_file)
    try:
        _read_all(file)
        opened = file.version
        _tick()
        _write_and_put_mtime_back(model_file, tmp_path)
        with pytest.raises(ModelFileChanged, match="modification time kept or put back"):
            file.check()
    finally:
        file.close()
    with pytest.raises(ModelFileChanged, match="Load the model again"):
        ModelFile(model_file, opened)


def test_where_a_version_proves_nothing_is_named(tmp_path, monkeypatch):
    """Network and FUSE file systems (attributes cached) and Windows (the change time is the
    creation time) are named; a local file system is not; the real mount table is read."""
    from offload_core.files import file_identity

    path = tmp_path / "m.safetensors"
    path.write_bytes(b"x")
    assert file_identity.file_system(os.stat("/").st_dev)  # this machine's root has a type
    assert file_identity.version_unreliable(str(path)) is None
    for kind, named in (("nfs4", True), ("cifs", True), ("fuse.sshfs", True), ("9p", True),
                        ("ext4", False), ("xfs", False), ("tmpfs", False), ("overlay", False)):
        monkeypatch.setattr(file_identity, "file_system", lambda dev, kind=kind: kind)
        why = file_identity.version_unreliable(str(path))
        assert (why is not None) == named, (kind, why)
        if named:
            assert kind in why, why
    monkeypatch.setattr(file_identity.os, "name", "nt")
    assert "Windows" in file_identity.version_unreliable(str(path))

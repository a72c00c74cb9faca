"""Which model a file is, and whether it is still the file the process read: the one place that
decides it, for the tiers' ids, the shared host copy and disk streaming's reads in place.

``file_version``: device, inode, size, modification and change time (ns). A model file that
changed on disk is a different model (``model_id`` covers its version), so new bytes never appear
under an old id. ``source_key`` leaves the version out: one key for every version of a file loaded
with the same options, so a newer version can supersede the older one.

Why the change time is in the version: a write moves it, and so does putting the modification
time back (``touch -d``, ``cp -p``, ``rsync -t``), so no one can change the bytes and keep the
version. But ``chmod``, ``chown`` and a new (or removed) hard link move it too, and change no
byte. So a version that moved is one of two kinds (``content_may_differ``):
- the device, inode, size or modification time moved: another file, or a write. The bytes are
  taken as changed, unchecked;
- only the change time moved: a change of metadata, or a write whose modification time was put
  back. Only the bytes can tell, so ``same_bytes`` compares them before anything is refused.

What the bytes are compared with (``Witness``): digests (SHA-256) of byte ranges of the file,
each taken from bytes read while the file was provably at the version (its version checked on
the same descriptor right after the read). Two ways to get them, both paid once per version:
- disk streaming reads its units from the file anyway: each range is digested at its first read
  (``note_read``), no read of its own. The ranges are what it runs from; a unit not read yet is
  compared with the loaded tensors at its first read, as always;
- a shared host copy holds the model as loaded (packed, maybe cast): nothing of it can be laid
  against the file's bytes. So the whole file is digested once, in the background, from the first
  time a shared model runs (``witness_whole``): one read of the file per process and version,
  never on the loading thread, never per prompt. Why not at the load itself: that would hold up
  every load, of every model, for a check that only a change of metadata ever needs.
A metadata-only change then costs one read of the witnessed ranges (the whole file for a shared
copy): the new version is remembered as holding the same bytes, so the next check is a stat and
a set lookup again. A file not witnessed yet (the digest still running, or started after the
change) is refused as before: the check never guesses.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from .raw_io import read_at

log = logging.getLogger(__name__)

CHUNK = 64 << 20  # the whole file is witnessed in ranges of this size (one digest each)
_READ = 8 << 20  # bytes per read while digesting


def file_version(st: os.stat_result) -> tuple[int, ...]:
    """What moves on whenever a file's bytes may have changed: its device and inode (a new file
    renamed over the name), its size, its modification time, and its inode change time. The last
    is why a version cannot be faked: a write moves it on, and so does putting the modification
    time back (``touch -d``, ``cp -p``), since that changes the inode too."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def content_may_differ(was: tuple[int, ...], now: tuple[int, ...]) -> bool:
    """Whether ``now`` is another file or a written one (device, inode, size or modification
    time moved), as opposed to one whose change time alone moved (``same_bytes`` decides that)."""
    return tuple(was[:4]) != tuple(now[:4])


def model_id(source_path: str | os.PathLike[str], version: tuple[int, ...], options: Mapping[str, Any]) -> str:
    """A short stable id for a model file loaded with given options.

    The id covers the resolved path, the file's version (``file_version``) and the load options
    (JSON with sorted keys, non-JSON values by ``str``), so a re-saved file or a different dtype is
    a different model and never reuses a stale parked copy.
    """
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "version": [int(v) for v in version],
         "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def source_key(source_path: str | os.PathLike[str], options: Mapping[str, Any]) -> str:
    """What ``model_id`` covers except the file's version: one key for every version of a file
    loaded with the same options, so a newer version can supersede the older one."""
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _digest_range(fd: int, offset: int, length: int) -> bytes | None:
    """SHA-256 of ``length`` bytes of the file at ``offset``; None where the file ends before."""
    h = hashlib.sha256()
    done = 0
    while done < length:
        chunk = read_at(fd, min(_READ, length - done), offset + done)
        if not chunk:
            return None
        h.update(chunk)
        done += len(chunk)
    return h.digest()


class Witness:
    """What the process knows of one file's bytes (one device and inode): the versions known to
    hold the same bytes (the first the one the ranges were read at, later ones confirmed), and the
    digests of ranges read at those versions; ``whole`` once the ranges cover the whole file."""

    def __init__(self, version: tuple[int, ...]) -> None:
        self.versions: set[tuple[int, ...]] = {version}
        self.ranges: dict[tuple[int, int], bytes] = {}
        self.whole = False
        self.digesting: threading.Thread | None = None


_witnesses: dict[tuple[int, int], Witness] = {}
_lock = threading.Lock()


def _witness_at(version: tuple[int, ...]) -> Witness:
    """The witness of ``version``'s file (under ``_lock``); a new one where the file's bytes may
    have changed since the old one's versions (its ranges then say nothing of this version)."""
    key = (version[0], version[1])
    found = _witnesses.get(key)
    if found is None or version not in found.versions:
        found = _witnesses[key] = Witness(version)
    return found


def note_read(fd: int, version: tuple[int, ...], offset: int, data: memoryview) -> None:
    """Witness ``data``, just read from ``fd`` at ``offset`` when the file was ``version``: its
    digest is kept only when the descriptor still shows that version after the read (a change
    before or during the read moves it), and only at the range's first read."""
    with _lock:
        witness = _witness_at(version)
        if (offset, len(data)) in witness.ranges:
            return
    digest = hashlib.sha256(data).digest()
    if file_version(os.fstat(fd)) != version:
        return
    with _lock:
        if version in witness.versions:
            witness.ranges[(offset, len(data))] = digest


def witness_whole(path: str, version: tuple[int, ...]) -> None:
    """Digest the whole file in the background, once per version, if it is still ``version``
    (checked before and after on the descriptor read): what ``same_bytes(..., whole=True)`` needs."""
    with _lock:
        witness = _witness_at(version)
        if witness.whole or witness.digesting is not None:
            return
        witness.digesting = threading.Thread(target=_digest_whole, args=(path, version, witness),
                                             name="tiered-offload-file-witness", daemon=True)
        witness.digesting.start()


def _digest_whole(path: str, version: tuple[int, ...], witness: Witness) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        if file_version(os.fstat(fd)) != version:
            return
        ranges = {}
        for offset in range(0, version[2], CHUNK):
            length = min(CHUNK, version[2] - offset)
            digest = _digest_range(fd, offset, length)
            if digest is None:
                return
            ranges[(offset, length)] = digest
        if file_version(os.fstat(fd)) != version:
            return
        with _lock:
            if version in witness.versions:
                witness.ranges.update(ranges)
                witness.whole = True
    except OSError as e:
        log.info("[tiered offload] %s could not be read to witness its bytes (%s)", path, e)
    finally:
        os.close(fd)


def _wait_for_digest(version: tuple[int, ...]) -> None:
    with _lock:
        witness = _witnesses.get((version[0], version[1]))
        thread = witness.digesting if witness is not None else None
    if thread is not None and thread is not threading.current_thread():
        thread.join()


# File systems whose ``stat`` may answer from a cache of attributes while reads fetch new bytes
# (network and FUSE file systems, WSL's mounts of Windows drives): a version read there cannot
# prove the bytes unchanged.
CACHED_ATTRIBUTES = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "drvfs", "afs", "fuse", "fuseblk",
                     "fuse.", "ceph", "glusterfs", "lustre", "gpfs")


def file_system(st_dev: int) -> str | None:
    """The type of the file system a device number belongs to (Linux: /proc/self/mountinfo), None
    where the system does not say."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and "-" in fields:
                    return fields[fields.index("-", 6) + 1]
    except (OSError, ValueError, IndexError):
        return None
    return None


def version_unreliable(path: str) -> str | None:
    """Why a file's version (``file_version``) cannot prove its bytes unchanged where it lies,
    or None where it can: on Windows the change time is the creation time (a same-size
    overwrite that puts the modification time back keeps the version); on network and FUSE file
    systems ``stat`` may answer from cached attributes for up to a minute while reads fetch new
    bytes. Reading such a file in place is not safe; the caller copies it instead."""
    if os.name == "nt":
        return "on Windows a file's change time is its creation time"
    try:
        kind = file_system(os.stat(path).st_dev)
    except OSError:
        return None
    if kind is not None and any(kind == k or (k.endswith(".") and kind.startswith(k)) for k in CACHED_ATTRIBUTES):
        return f"it lies on a {kind} file system, whose file attributes may be cached"
    return None


def same_bytes(path: str, was: tuple[int, ...], *, whole: bool = False,
               fd: int | None = None) -> tuple[int, ...] | None:
    """The file's version now, if its bytes are known to be those it had at ``was`` (the same
    version, or one whose change time alone moved and whose witnessed bytes read back the same);
    else None: gone, another file, written, or not witnessed (``whole``: the caller relies on every
    byte of the file, so only a witness of the whole file counts). ``fd``: the file is this open
    descriptor (whatever its name leads to now), else the one ``path`` names.

    A metadata-only change is confirmed once: its version joins the witness's, so the next call
    is a stat and a lookup. One log line says so."""
    if fd is not None:
        return _same_bytes_of(fd, path, was, whole)
    try:
        opened = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return _same_bytes_of(opened, path, was, whole)
    finally:
        os.close(opened)


def _same_bytes_of(fd: int, path: str, was: tuple[int, ...], whole: bool) -> tuple[int, ...] | None:
    now = file_version(os.fstat(fd))
    if now == tuple(was):
        return now
    if content_may_differ(was, now):
        return None
    _wait_for_digest(was)
    with _lock:
        witness = _witnesses.get((now[0], now[1]))
        if witness is None or tuple(was) not in witness.versions or (whole and not witness.whole) \
                or not witness.ranges:
            return None
        if now in witness.versions:
            return now
        ranges = dict(witness.ranges)
    for (offset, length), digest in ranges.items():
        if _digest_range(fd, offset, length) != digest:
            return None
    if file_version(os.fstat(fd)) != now:
        return None  # changed again while read: the next check decides
    with _lock:
        if tuple(was) not in witness.versions:
            return None
        witness.versions.add(now)
    log.info("[tiered offload] metadata of %s changed (mode/owner/links); its bytes are unchanged (checked)", path)
    return now

"""Where shared host stores live: a folder of the user's own, files only the user can read, names
that cannot leave the folder, locks that say who holds what, and stores of dead processes removed.

Why a folder of one's own: the roots stores go below (``/dev/shm``, a disk folder the server's
owner allows) are usually open to every user of the machine. A store in such a root could be
made, or swapped for another file, by someone else, and its bytes would become another user's
weights. So every store lives in ``tiered-offload-<uid>`` below the root, which must be a real
folder (not a link) owned by this user and closed to everyone else (mode 0700); anything else is
refused with a clear error, never used. Every file in it is made with mode 0600, opened without
following links and relative to the folder's own descriptor, and named from a hex digest checked
by a pattern, so no name can point outside it.

Who holds a store: each process that maps it keeps a shared ``flock`` on its file for as long as
it does. The kernel drops that lock when the process ends, however it ends (a ``kill -9``
included), so "no lock left" means "no live process holds it": the last process to let go, or
the next one to look (``sweep``, at start), removes it. Every step that creates, joins or removes
a store runs under the store's lock file, held exclusively and briefly, except while a store is
being written: then the packer keeps it, and every other process that needs the same store waits
for it instead of packing the same bytes again.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..units import size_text

try:
    import fcntl
except ImportError:  # Windows: no flock, so no sharing (``SUPPORTED``)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# What stores need of the system: flock (holders that vanish with their process), and allocating a
# file's blocks up front (a shared mapping of a file that cannot grow kills its process on write).
SUPPORTED = fcntl is not None and hasattr(os, "posix_fallocate") and hasattr(os, "O_NOFOLLOW")

STORE_SUFFIX = ".store"
LOCK_SUFFIX = ".lock"
PART_SUFFIX = ".part"  # a store being written: <digest>.<pid>.part, renamed to <digest>.store when complete
DIGEST = re.compile(r"[0-9a-f]{32}")
_ENTRY = re.compile(r"(?P<digest>[0-9a-f]{32})(?:\.(?P<pid>\d+))?\.(?P<kind>store|part|lock)")
_POLL_S = 0.05
SHARED_MEMORY = "shared memory"
DISK = "disk"
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM)


class FolderRefused(ValueError):
    """The store folder is not this user's own (another owner, open to others, a link)."""


class StoreUnavailable(Exception):
    """A store cannot be used here, for a reason a private copy cures (no room, a store of the
    same name that disagrees, a missing folder, a system without what stores need): the caller
    packs privately and says why."""


def no_room(e: OSError) -> bool:
    """Whether ``e`` says the folder cannot hold more bytes (full, over a quota or file-size limit)."""
    return e.errno in _NO_ROOM


def user_folder_name() -> str:
    return f"tiered-offload-{os.geteuid()}"


def check_name(digest: str) -> str:
    """``digest`` if it can only name a file inside the folder: 32 lowercase hex digits."""
    if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
        raise ValueError(f"not a store name: {digest!r}")
    return digest


def check_own_file(fd: int, what: str) -> os.stat_result:
    """The stat of an open file, refused unless it is a regular file of this user that no one
    else may read or write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise FolderRefused(f"{what} is not a private file of this user (owner uid {st.st_uid}, mode "
                            f"{stat.S_IMODE(st.st_mode):o}); refusing to use it")
    return st


def holders(fd: int) -> int | None:
    """How many open files hold a lock on ``fd``'s file (each process that maps a store holds one),
    from /proc/locks; None where the system does not say."""
    st = os.fstat(fd)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    count = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "->" marks a waiter, not a holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                count += 1
        except ValueError:
            continue
    return count


def try_exclusive(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` if no one else holds one; whether it was taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def hold_shared(fd: int) -> None:
    """Take a shared flock on ``fd``: this process holds the file (it maps it) until it closes it."""
    fcntl.flock(fd, fcntl.LOCK_SH)


class StoreFolder:
    """``tiered-offload-<uid>`` below ``root``: where this user's stores live. ``kind`` says what
    the root is (``SHARED_MEMORY`` or ``DISK``). Nothing is made until ``open``."""

    def __init__(self, root: str, kind: str) -> None:
        self.root = os.path.realpath(root)
        self.path = os.path.join(self.root, user_folder_name())
        self.kind = kind

    @property
    def in_memory(self) -> bool:
        """Whether the folder's files are RAM (shared memory), not a disk's pages."""
        return self.kind == SHARED_MEMORY

    def __repr__(self) -> str:
        return f"StoreFolder({self.path!r}, {self.kind!r})"

    def open(self) -> int:
        """A descriptor of the folder, made (0700) if missing; FolderRefused unless it is a real
        folder of this user closed to everyone else, StoreUnavailable without the root."""
        if not SUPPORTED:
            raise StoreUnavailable("this system has no shared-lock files (flock) or file allocation; "
                                   "sharing host memory needs Linux")
        if not os.path.isdir(self.root):
            raise StoreUnavailable(f"there is no folder {self.root}")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FolderRefused(f"{self.path} is not a folder (a link or a file); refusing to keep "
                                    "shared host stores there") from None
            raise
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise FolderRefused(
                f"{self.path} is not this user's own folder (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.geteuid()}, mode 700): refusing to share "
                "host memory through it. Remove it, or choose another folder")
        return fd

    def free_bytes(self) -> int:
        """Bytes an unprivileged user may still write there."""
        st = os.statvfs(self.path if os.path.isdir(self.path) else self.root)
        return st.f_bavail * st.f_frsize

    @contextmanager
    def locked(self, dfd: int, digest: str, waiting: Callable[[], None] | None = None,
               wait: bool = True) -> Iterator[int | None]:
        """Hold the store's lock file exclusively; yields its descriptor, or None when ``wait`` is
        false and someone else holds it. ``waiting()`` is called while another process holds it
        (it may raise to give up: an interrupt)."""
        fd = self.lock(dfd, digest, waiting, wait)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def lock(dfd: int, digest: str, waiting: Callable[[], None] | None = None, wait: bool = True) -> int | None:
        """``locked`` without the context: the caller closes the descriptor to let go."""
        name = check_name(digest) + LOCK_SUFFIX
        while True:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                check_own_file(fd, f"the lock file {name}")
                while not try_exclusive(fd):
                    if not wait:
                        os.close(fd)
                        return None
                    if waiting is not None:
                        waiting()
                    time.sleep(_POLL_S)
                # The last holder of a store removes its lock file too: the one we locked must
                # still be the one the name shows, or another process may hold the new one.
                try:
                    named = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    os.close(fd)
                    continue
                mine = os.fstat(fd)
                if (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino):
                    os.close(fd)
                    continue
                return fd
            except BaseException:
                os.close(fd)
                raise

    @staticmethod
    def remove(dfd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass

    @staticmethod
    def remove_parts(dfd: int, digest: str) -> list[str]:
        """Under the store's lock: remove its part files, which packers that are gone left (a
        packer holds the lock for as long as it writes)."""
        removed = []
        for name in os.listdir(dfd):
            m = _ENTRY.fullmatch(name)
            if m is not None and m["digest"] == digest and m["kind"] == "part":
                StoreFolder.remove(dfd, name)
                removed.append(name)
        return removed

    def sweep(self) -> list[str]:
        """Remove what dead processes left: stores no live process holds, stores half written by
        a packer that is gone, and their lock files. Entries someone is busy with are left alone.
        Returns the names removed."""
        if not SUPPORTED or not os.path.isdir(self.path):
            return []
        dfd = self.open()
        removed: list[str] = []
        try:
            entries = [m for name in os.listdir(dfd) if (m := _ENTRY.fullmatch(name)) is not None]
            for digest in sorted({m["digest"] for m in entries}):
                with self.locked(dfd, digest, wait=False) as lock:
                    if lock is None:
                        continue  # a process is packing, joining or letting go of it right now
                    removed += self._sweep_one(dfd, digest, [m.group(0) for m in entries
                                                             if m["digest"] == digest])
        finally:
            os.close(dfd)
        if removed:
            log.info("shared host stores: removed %d files that processes which have ended left in %s: %s",
                     len(removed), self.path, ", ".join(removed))
        return removed

    def _sweep_one(self, dfd: int, digest: str, names: list[str]) -> list[str]:
        """Under the store's lock: a part file's packer is gone (it held this lock while writing),
        and a store without a holder belongs to no live process."""
        removed = []
        for name in names:
            if name.endswith(PART_SUFFIX):
                self.remove(dfd, name)
                removed.append(name)
        store = digest + STORE_SUFFIX
        if store in names:
            try:
                fd = os.open(store, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    if try_exclusive(fd):
                        size = os.fstat(fd).st_size
                        self.remove(dfd, store)
                        removed.append(f"{store} ({size_text(size)})")
                    else:
                        return removed  # held: the lock file stays with it
                finally:
                    os.close(fd)
        self.remove(dfd, digest + LOCK_SUFFIX)
        return removed

"""Where shared host stores live: a folder of the user's own, files only the user can read, names
that cannot leave the folder, locks that say who holds what, and stores of dead processes removed.

Why a folder of one's own: the roots stores go below (``/dev/shm``, a disk folder the server's
owner allows) are usually open to every user of the machine. A store in such a root could be
made, or swapped for another file, by someone else, and its bytes would become another user's
weights. So every store lives in ``tiered-offload-<uid>`` below the root, which must be a real
folder (not a link) owned by this user and closed to everyone else (mode 0700); anything else is
never used. Every file in it is made with mode 0600, opened without following links, without
blocking (a FIFO named like a store must not hang the process) and relative to the folder's own
descriptor, and used only when it is a regular file of this user closed to others; names come
from a hex digest checked by a pattern, so no name can point outside it.

Sharing is an optimisation, never a failure: every reason a store cannot be used here (a folder
or file that is not the user's own, no room, a store bigger than its share of the folder, a
packer that holds the lock without writing for ``LOCK_WAIT_S``) raises ``StoreUnavailable`` with
what to do, and the caller packs privately.

Who holds a store: each process that maps it keeps a shared ``flock`` on its file for as long as
it does. The kernel drops that lock when the process ends, however it ends (a ``kill -9``
included), so "no lock left" means "no live process holds it": the last process to let go, or
the next one to look (``sweep``: at start, at every pack and after every prompt), removes it. A
child forked without exec shares its parent's open files, and a mapping holds its file open too,
so the child lets go of them (``drop_inherited_holds``), or a store would outlive its holders.
Every step that creates, joins or removes a store runs under the store's lock file, held
exclusively and briefly, except while a store is being written: then the packer keeps it, and
every other process that needs the same store waits for it (while it makes progress) instead of
packing the same bytes again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..units import size_text
from .store_view import own_pages

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

# How long a process waits for a store's lock while its holder writes nothing (a stopped packer, a
# hung disk) before it packs privately; a packer that makes progress is waited for however long it
# takes, since packing the same bytes again would hold them twice. Read at each wait (tests shorten it).
LOCK_WAIT_S = 120.0
# Letting go waits for the lock this long at most: live processes hold it only briefly then, and a
# store left by a let-go that gave up is removed by the next sweep once no one holds it.
LET_GO_WAIT_S = 10.0
# Sweeps at every pack and prompt end look at a folder at most this often per process.
SWEEP_EVERY_S = 1.0
# The share of a shared-memory folder's size one store may take unless the server's owner says.
DEFAULT_MAX_SHARE = 0.5
_OTHER_FOLDER = "choose another folder for shared stores"

_lock_fds: set[int] = set()  # lock files this process holds open (``lock``): a forked child closes them
_last_sweep: dict[str, float] = {}  # folder path -> when this process last swept it (``sweep_if_due``)
_said: set[str] = set()  # warnings given once per process (``_warn_once``)


class StoreUnavailable(Exception):
    """A store cannot be used here, for a reason a private copy cures (no room, a store of the
    same name that disagrees, a missing folder, a system without what stores need): the caller
    packs privately and says why."""


class FolderRefused(StoreUnavailable):
    """The store folder, or a file in it, is not this user's own (another owner, open to others, a
    link, not a regular file): never read or written, and the caller packs privately."""


def no_room(e: OSError) -> bool:
    """Whether ``e`` says the folder cannot hold more bytes (full, over a quota or file-size limit)."""
    return e.errno in _NO_ROOM


def _warn_once(message: str) -> None:
    """One log line per process for a state that every sweep would otherwise report again."""
    if message not in _said:
        _said.add(message)
        log.warning("[tiered offload] %s", message)


def user_folder_name() -> str:
    return f"tiered-offload-{os.geteuid()}"


def check_name(digest: str) -> str:
    """``digest`` if it can only name a file inside the folder: 32 lowercase hex digits."""
    if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
        raise ValueError(f"not a store name: {digest!r}")
    return digest


def max_share(value: object, where: str) -> float:
    """``value`` as the fraction (0 to 1) of a folder's size one store may take; anything else
    (not a number, NaN, out of range) gives ``DEFAULT_MAX_SHARE`` and one log line naming ``where``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return float(value)  # NaN fails the range test
    _warn_once(f"shared host stores: {where} is {value!r}, not a fraction from 0 to 1; using "
               f"{DEFAULT_MAX_SHARE:g}")
    return DEFAULT_MAX_SHARE


def _kind_of(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISLNK, "a link"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a device"


def check_own_file(fd: int, what: str) -> os.stat_result:
    """The stat of an open file; FolderRefused unless it is a regular file of this user that no
    one else may read or write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise FolderRefused(
            f"{what} is not a private file of this user ({_kind_of(st.st_mode)}, owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; expected a file of uid {os.geteuid()}, mode 600), so it is not "
            "used and this process keeps a private copy. Remove it if no process of yours needs it")
    return st


def open_own_file(dfd: int, name: str, flags: int, what: str) -> int:
    """Open ``name`` in the folder ``dfd`` (``os.O_CREAT`` makes it with mode 0600) without
    following a link and without blocking, and keep it only if ``check_own_file`` passes: a FIFO
    or device named like a store is refused before anything reads it. FileNotFoundError passes
    on (a missing file is the caller's case); any other failure is ``StoreUnavailable``."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FolderRefused(f"{what} is a link, so it is not used and this process keeps a private "
                                "copy. Remove the link") from None
        raise StoreUnavailable(f"{what} cannot be opened ({e.strerror}); this process keeps a private copy") \
            from None
    try:
        check_own_file(fd, what)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def unlock(fd: int) -> None:
    """Let go of a lock file ``StoreFolder.lock`` gave."""
    _lock_fds.discard(fd)
    os.close(fd)


def close_lock_files_in_child() -> None:
    """In a child forked without exec: close the lock files the parent held (a flock belongs to
    the open file, which parent and child now share), so they do not stay locked once the parent
    has let go or ended. The parent's own descriptors and locks are untouched. Called by the
    sharing room's one fork handler (``shared_store``), before its stores are let go of."""
    for fd in list(_lock_fds):
        _lock_fds.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


_MAP_FIXED = 0x10  # Linux, every architecture


def drop_inherited_holds(fds: list[int]) -> None:
    """In a child forked without exec: close the store files open as ``fds`` (inherited, with the
    parent's flocks on them) while every mapping of them in this process stays where it is.

    Why more than closing them: a flock lasts while its open file does, and every mapping of the
    file (and the copy of the descriptor Python's ``mmap`` keeps) holds it open too, so a child
    that maps a store would keep it "held" after the parent ended. Each such mapping is mapped
    again at the same address from an open file of the child's own, which holds no lock; pages
    written in a private (copy-on-write) mapping are copied back, so the child reads what it read
    before. Every other descriptor of those files becomes /dev/null (whoever owns it closes it)."""
    files = {}
    for fd in fds:
        st = os.fstat(fd)
        files.setdefault((st.st_dev, st.st_ino), fd)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for (dev, ino), fd in files.items():
        fresh = os.open(f"/proc/self/fd/{fd}", (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) | os.O_CLOEXEC)
        try:
            for fields in regions:
                if len(fields) < 6 or int(fields[4]) != ino \
                        or tuple(int(x, 16) for x in fields[3].split(":")) != (os.major(dev), os.minor(dev)):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                perms, offset = fields[1], int(fields[2], 16)
                prot = (mmap.PROT_READ if "r" in perms else 0) | (mmap.PROT_WRITE if "w" in perms else 0)
                private = perms[3] == "p"
                written = _written_pages(start, end) if private and "w" in perms else {}
                flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | _MAP_FIXED
                if libc.mmap(start, end - start, prot, flags, fresh, offset) != start:
                    raise OSError(ctypes.get_errno(), f"mapping a store again at {start:#x} failed")
                for at, data in written.items():
                    ctypes.memmove(at, data, len(data))
        finally:
            os.close(fresh)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                st = os.stat(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in files and int(name) != null:
                os.dup2(null, int(name), inheritable=False)
    finally:
        os.close(null)
    for fd in fds:
        os.close(fd)


def _written_pages(start: int, end: int) -> dict[int, bytes]:
    """The pages between ``start`` and ``end`` (a private file mapping) that are this process's own
    copies (written since they were mapped), by address, with their bytes."""
    own = own_pages(start, end)
    if own is None:
        raise OSError("/proc/self/pagemap cannot be read: the pages written here are unknown")
    page = mmap.PAGESIZE
    out = {}
    i = own.find(1)
    while i >= 0:
        at = start + i * page
        out[at] = ctypes.string_at(at, page)
        i = own.find(1, i + 1)
    return out


class StoreFolder:
    """``tiered-offload-<uid>`` below ``root``: where this user's stores live. ``kind`` says what
    the root is (``SHARED_MEMORY`` or ``DISK``); ``max_share`` is the fraction of the root's size
    one store may take (None: no cap); ``choose_another`` tells a person how to keep stores
    elsewhere (said when the folder is refused). Nothing is made until ``open``."""

    def __init__(self, root: str, kind: str, *, max_share: float | None = None,
                 choose_another: str = _OTHER_FOLDER) -> None:
        self.root = os.path.realpath(root)
        self.path = os.path.join(self.root, user_folder_name())
        self.kind = kind
        self.max_share = max_share
        self.choose_another = choose_another

    @property
    def in_memory(self) -> bool:
        """Whether the folder's files are RAM (shared memory), not a disk's pages."""
        return self.kind == SHARED_MEMORY

    def __repr__(self) -> str:
        return f"StoreFolder({self.path!r}, {self.kind!r})"

    def open(self) -> int:
        """A descriptor of the folder, made (0700) if missing. FolderRefused unless it is a real
        folder of this user closed to everyone else (another local user may have made it first),
        StoreUnavailable without the root or on a system without what stores need."""
        if not SUPPORTED:
            raise StoreUnavailable("this system has no shared-lock files (flock) or file allocation; "
                                   "sharing host memory needs Linux")
        if not os.path.isdir(self.root):
            raise StoreUnavailable(f"there is no folder {self.root}; {self.choose_another}")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise StoreUnavailable(f"{self.path} cannot be made ({e.strerror}); {self.choose_another}") from None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FolderRefused(
                    f"{self.path} is not a folder (a link or a file), so shared host stores are not kept "
                    f"there and this process keeps a private copy. Remove it, or {self.choose_another}") from None
            raise StoreUnavailable(f"{self.path} cannot be opened ({e.strerror}); {self.choose_another}") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise FolderRefused(
                f"{self.path} is not this user's own folder (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.geteuid()}, mode 700): another user may "
                "have made it to read or swap the stores, so it is not used and this process keeps a "
                f"private copy. Remove it (its owner or root can), or {self.choose_another}")
        return fd

    def free_bytes(self) -> int:
        """Bytes an unprivileged user may still write there."""
        st = os.statvfs(self.path if os.path.isdir(self.path) else self.root)
        return st.f_bavail * st.f_frsize

    def check_share(self, nbytes: int) -> None:
        """StoreUnavailable when a store of ``nbytes`` would take more of the root's size than
        ``max_share`` allows (the rest of shared memory stays for everything else on the machine)."""
        if self.max_share is None:
            return
        st = os.statvfs(self.root)
        total = st.f_blocks * st.f_frsize
        if total and nbytes > self.max_share * total:
            raise StoreUnavailable(
                f"the store needs {size_text(nbytes)}, more than the {self.max_share * 100:.3g}% of {self.root} "
                f"({size_text(total)}) one store may take; this process keeps a private copy. Allow one store a "
                "larger share of the folder, or give the folder more room")

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
                unlock(fd)

    @staticmethod
    def lock(dfd: int, digest: str, waiting: Callable[[], None] | None = None, wait: bool = True,
             bound_s: float | None = None) -> int | None:
        """``locked`` without the context: the caller lets go with ``unlock``. StoreUnavailable
        once another process has held the lock for ``bound_s`` (``LOCK_WAIT_S`` unless given)
        without a byte of the store's part files changing: a packer that is stopped or stuck is
        not waited for forever."""
        name = check_name(digest) + LOCK_SUFFIX
        bound = LOCK_WAIT_S if bound_s is None else bound_s
        seen, since = None, time.monotonic()
        while True:
            fd = open_own_file(dfd, name, os.O_RDWR | os.O_CREAT, f"the lock file {name}")
            _lock_fds.add(fd)
            try:
                while not try_exclusive(fd):
                    if not wait:
                        unlock(fd)
                        return None
                    if waiting is not None:
                        waiting()
                    now, progress = time.monotonic(), _part_sizes(dfd, digest)
                    if progress != seen:
                        seen, since = progress, now
                    elif now - since >= bound:
                        raise StoreUnavailable(
                            f"another process has held the store {digest}'s lock for {now - since:.0f} s "
                            "without writing to it (stopped, or stuck on a slow disk); this process keeps a "
                            "private copy")
                    time.sleep(_POLL_S)
                # The last holder of a store removes its lock file too: the one we locked must
                # still be the one the name shows, or another process may hold the new one.
                try:
                    named = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    unlock(fd)
                    continue
                mine = os.fstat(fd)
                if (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino):
                    unlock(fd)
                    continue
                return fd
            except BaseException:
                if fd in _lock_fds:
                    unlock(fd)
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

    def sweep_if_due(self) -> list[str]:
        """``sweep``, unless this process swept the folder less than ``SWEEP_EVERY_S`` ago: what
        runs at every pack and prompt end stays a listdir and a try-lock per store now and then."""
        now = time.monotonic()
        if now - _last_sweep.get(self.path, -math.inf) < SWEEP_EVERY_S:
            return []
        _last_sweep[self.path] = now
        return self.sweep()

    def sweep(self) -> list[str]:
        """Remove what dead processes left: stores no live process holds, stores half written by
        a packer that is gone, and their lock files. Entries someone is busy with are left alone,
        and so is whatever is not this user's own regular file (said once). Never raises for a
        folder or an entry that cannot be used. Returns the names removed."""
        if not SUPPORTED or not os.path.isdir(self.path):
            return []
        try:
            dfd = self.open()
        except StoreUnavailable as e:  # every pack into it says why it is not used
            log.debug("[tiered offload] shared host stores: %s is not swept: %s", self.path, e)
            return []
        removed: list[str] = []
        try:
            entries = [m for name in os.listdir(dfd) if (m := _ENTRY.fullmatch(name)) is not None]
            for digest in sorted({m["digest"] for m in entries}):
                try:
                    with self.locked(dfd, digest, wait=False) as lock:
                        if lock is None:
                            continue  # a process is packing, joining or letting go of it right now
                        removed += self._sweep_one(dfd, digest, [m.group(0) for m in entries
                                                                 if m["digest"] == digest])
                except (StoreUnavailable, OSError) as e:
                    _warn_once(f"shared host stores: {digest} in {self.path} is left alone: {e}")
        except OSError as e:
            _warn_once(f"shared host stores: {self.path} could not be swept ({e})")
        finally:
            os.close(dfd)
        if removed:
            log.info("[tiered offload] shared host stores: removed %d files that processes which have ended "
                     "left in %s: %s",
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
                fd = open_own_file(dfd, store, os.O_RDONLY, os.path.join(self.path, store))
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


def _part_sizes(dfd: int, digest: str) -> list[tuple[str, int, int]]:
    """The store's part files with their sizes and allocated blocks: what changes while its packer
    writes (each chunk is allocated as it is written)."""
    out = []
    for name in os.listdir(dfd):
        m = _ENTRY.fullmatch(name)
        if m is not None and m["digest"] == digest and m["kind"] == "part":
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append((name, st.st_size, st.st_blocks))
    return sorted(out)

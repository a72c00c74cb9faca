"""The sources `make test` needs that no package registry serves, each checked against a recorded digest.

ComfyUI 0.33.0 (the second test lane's tree) and the third-party packs the tests load beside the
pack (ComfyUI-GGUF, ComfyUI-Distributed). Each is taken from the first place that has it:

1. `../shared/` beside the clone (the project's build machines and CI, without network);
2. its archive already in `.sources/downloads/` (placed by hand, or downloaded before);
3. its public archive on GitHub (or under `$TIERED_OFFLOAD_SOURCES_MIRROR`, a base URL that serves
   the same file names), saved in `.sources/downloads/`.

Whatever the place, the unpacked tree must match the tree digest recorded below: the SHA-256 of
its sorted "SHA-256 of the file, two spaces, path" lines. A digest of the content, not of the
archive, because an archive's bytes change with its packer while the files do not. Files named in
`left_out` (absent from the tree CI runs) are removed before the check. A tree that does not
match, or an archive that cannot be had, stops the build with one line naming what to fetch and
where to put it.

Standard library only: it runs before any environment exists.

    python3 tools/sources.py get NAME DEST     # the tree NAME, unpacked at DEST
    python3 tools/sources.py digest DIR        # the tree digest of a folder
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DOWNLOADS = REPO / ".sources" / "downloads"
MIRROR_VARIABLE = "TIERED_OFFLOAD_SOURCES_MIRROR"


@dataclass(frozen=True)
class Source:
    name: str
    shared: str  # under ../shared/: a tarball with one top folder, or a folder
    url: str  # the public archive (a .tar.gz with one top folder)
    digest: str  # the tree digest (module docstring)
    left_out: tuple[str, ...] = ()

    @property
    def archive_name(self) -> str:
        return f"{self.name}.tar.gz"


SOURCES = {s.name: s for s in (
    Source("comfyui-0.33.0", "comfyui/comfyui-0.33.0.tar.gz",
           "https://github.com/comfyanonymous/ComfyUI/archive/refs/tags/v0.33.0.tar.gz",
           "a373ba0128cd4660a4277aaba76b8d46c97539cd98a04475af127bcc03a3aaf8",
           # Two tokenizers the tests' tree lacks (only two text encoders the tests never load
           # read them): left out wherever the tree comes from, so every tree is the same.
           left_out=("comfy/text_encoders/llama_tokenizer/tokenizer.json",
                     "comfy/text_encoders/qwen35_tokenizer/vocab.json")),
    Source("ComfyUI-GGUF", "third_party/ComfyUI-GGUF",
           "https://github.com/city96/ComfyUI-GGUF/archive/795e45156ece99afbc3efef911e63fcb46e6a20d.tar.gz",
           "efe58dcd6b07dee5df3675161cfad4e4977a1b4edc6ce1cd9308858cf61e3117"),
    Source("ComfyUI-Distributed", "third_party/ComfyUI-Distributed",
           "https://github.com/robertvoy/ComfyUI-Distributed/archive/a91f9fb081eb5fc27db429a7c3f35d2ef7ce4a50.tar.gz",
           "9edec6be5c851a1dc2df687a391ad8cbf29d8883adefb09167fd82a645e42695"),
)}


class SourceError(Exception):
    """What to fetch and where to put it, in one line."""


def tree_digest(folder: Path) -> str:
    """The SHA-256 of the folder's sorted "file SHA-256, two spaces, path" lines (files only)."""
    lines = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        file_hash = hashlib.sha256()
        if path.is_symlink():
            file_hash.update(b"symlink:" + os.readlink(path).encode())
        else:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    file_hash.update(chunk)
        lines.append(f"{file_hash.hexdigest()}  {path.relative_to(folder).as_posix()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _remedy(source: Source) -> str:
    return (f"download {source.url} and put it at {DOWNLOADS / source.archive_name}"
            f" (or give ../shared/{source.shared} beside this clone)")


def _unpack(archive: Path, into: Path) -> Path:
    """Unpack a .tar.gz with one top folder into ``into``; returns that folder."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.10.12, 3.11.4 and later
                tar.extractall(into, filter="data")
            else:
                for member in tar.getmembers():
                    if member.name.startswith(("/", "..")) or "/../" in member.name or member.islnk() \
                            or member.issym() or member.isdev():
                        raise SourceError(f"{archive} holds {member.name!r}, which may not be unpacked")
                tar.extractall(into)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceError(f"{archive} is not a readable .tar.gz ({e})") from None
    tops = [p for p in into.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        raise SourceError(f"{archive} does not hold one top folder")
    return tops[0]


def _download(source: Source) -> None:
    """Save the source's archive in DOWNLOADS (whole, or not at all)."""
    mirror = os.environ.get(MIRROR_VARIABLE)
    url = f"{mirror.rstrip('/')}/{source.archive_name}" if mirror else source.url
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    target = DOWNLOADS / source.archive_name
    partial = target.with_name(target.name + ".part")
    print(f"sources: downloading {url}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except (urllib.error.URLError, OSError, ValueError) as e:
        partial.unlink(missing_ok=True)
        raise SourceError(f"could not download {url} ({getattr(e, 'reason', e)}); "
                          f"{_remedy(source)}") from None
    partial.replace(target)


def _checked(source: Source, tree: Path, origin: str) -> None:
    for name in source.left_out:
        (tree / name).unlink(missing_ok=True)
    found = tree_digest(tree)
    if found != source.digest:
        raise SourceError(f"{source.name} from {origin} is not the recorded tree (digest {found[:16]}…, "
                          f"recorded {source.digest[:16]}…); {_remedy(source)}")


def get(name: str, dest: Path) -> str:
    """Unpack the tree ``name`` at ``dest`` (replaced), checked; returns where it came from."""
    source = SOURCES[name]
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as work:
        work = Path(work)
        shared = SHARED / source.shared
        downloaded = DOWNLOADS / source.archive_name
        if shared.is_dir():
            origin = str(shared)
            tree = work / "tree"
            shutil.copytree(shared, tree, symlinks=True)
            _checked(source, tree, origin)
        elif shared.is_file():
            origin, tree = str(shared), _unpack(shared, work)
            _checked(source, tree, origin)
        else:
            fresh = not downloaded.is_file()
            if fresh:
                _download(source)
            origin = str(downloaded)
            try:
                tree = _unpack(downloaded, work)
                _checked(source, tree, origin)
            except SourceError:
                if fresh:  # not what was asked for: the next run downloads it again
                    downloaded.unlink(missing_ok=True)
                raise
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        tree.replace(dest)
    return origin


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "get" and argv[1] in SOURCES:
        try:
            origin = get(argv[1], Path(argv[2]))
        except SourceError as e:
            print(f"sources: {e}", file=sys.stderr)
            return 1
        print(f"sources: {argv[1]} from {origin}, checked", file=sys.stderr)
        return 0
    if len(argv) == 2 and argv[0] == "digest":
        print(tree_digest(Path(argv[1])))
        return 0
    print(f"usage: sources.py get {{{','.join(SOURCES)}}} DEST | sources.py digest DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make test` on a clone without ../shared/: the sources no registry serves (tools/sources.py).

Each case copies the Makefile and tools/ into a fresh folder with nothing beside it (no
../shared/), so the tool takes what it is given there: an archive placed in .sources/downloads/,
one served on the loopback (the mirror variable points its downloads there), or none (a closed
port), and is held to the recorded digests. The archives are made from CI's own copies in
../shared/ in the layout GitHub's archives have (one top folder named after the version), the
ComfyUI one with the two files the tests' tree lacks put back.
"""
from __future__ import annotations

import functools
import http.server
import io
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import sources  # noqa: E402

COMFY = sources.SOURCES["comfyui-0.33.0"]
GGUF = sources.SOURCES["ComfyUI-GGUF"]
needs_shared = pytest.mark.skipif(not (sources.SHARED / COMFY.shared).is_file()
                                  or not (sources.SHARED / GGUF.shared).is_dir(),
                                  reason="needs CI's copies in ../shared/ to make the archives from")


@pytest.fixture
def clone(tmp_path) -> Path:
    """The Makefile and tools/ of this checkout, with no ../shared/ beside them."""
    root = tmp_path / "clone"
    root.mkdir()
    shutil.copy2(REPO / "Makefile", root / "Makefile")
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    assert not (root.parent / "shared").exists()
    return root


def github_archive(source: sources.Source, out: Path, *, change: str | None = None) -> Path:
    """``source`` as GitHub packs it: one top folder, with the files left out of CI's tree put
    back; ``change``: a file whose bytes are changed."""
    shared = sources.SHARED / source.shared
    work = out.parent / f"{source.name}-unpacked"
    if shared.is_dir():
        tree = work / f"{source.name}-main"
        shutil.copytree(shared, tree)
    else:
        with tarfile.open(shared) as tar:
            tar.extractall(work, filter="data")
        tree = work / f"{source.name}-gh"
        (work / "ComfyUI").rename(tree)
    for name in source.left_out:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text('{"a tokenizer": "the tests never read"}')
    if change is not None:
        with open(tree / change, "ab") as f:
            f.write(b"\n# changed\n")
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    shutil.rmtree(work)
    return out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns


def make(clone: Path, target: str, mirror: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(clone), sources.MIRROR_VARIABLE: mirror}
    return subprocess.run(["make", "-C", str(clone), target, f"PYTHON={sys.executable}"],
                          capture_output=True, text=True, env=env, timeout=300)


def said(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("sources: ")]


@pytest.mark.parametrize("name", list(sources.SOURCES))
def test_ci_s_copies_are_the_recorded_trees(tmp_path, name):
    source = sources.SOURCES[name]
    if not (sources.SHARED / source.shared).exists():
        pytest.skip(f"needs ../shared/{source.shared}")
    assert sources.get(name, tmp_path / name) == str(sources.SHARED / source.shared)
    assert sources.tree_digest(tmp_path / name) == source.digest


@needs_shared
def test_a_placed_archive_gives_the_recorded_tree(clone):
    downloads = clone / ".sources" / "downloads"
    downloads.mkdir(parents=True)
    github_archive(COMFY, downloads / COMFY.archive_name)
    result = make(clone, ".comfyui-033/.ready", f"http://127.0.0.1:{closed_port()}")
    assert result.returncode == 0, result.stdout + result.stderr
    tree = clone / ".comfyui-033"
    assert (tree / ".ready").is_file() and (tree / "comfy" / "model_patcher.py").is_file()
    assert not any((tree / name).exists() for name in COMFY.left_out)
    (tree / ".ready").unlink()
    assert sources.tree_digest(tree) == COMFY.digest
    assert said(result) == [f"sources: comfyui-0.33.0 from {downloads / COMFY.archive_name}, checked"]


@needs_shared
def test_a_served_archive_is_downloaded_checked_and_kept(clone, tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    github_archive(GGUF, served / GGUF.archive_name)
    handler = functools.partial(QuietHandler, directory=str(served))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            result = make(clone, ".sources/third_party/ComfyUI-GGUF.ready",
                          f"http://127.0.0.1:{server.server_address[1]}/")
        finally:
            server.shutdown()
    assert result.returncode == 0, result.stdout + result.stderr
    kept = clone / ".sources" / "downloads" / GGUF.archive_name
    assert kept.read_bytes() == (served / GGUF.archive_name).read_bytes()
    assert sources.tree_digest(clone / ".sources" / "third_party" / "ComfyUI-GGUF") == GGUF.digest
    assert (clone / ".sources" / "third_party" / "ComfyUI-GGUF.ready").is_file()


def test_without_an_archive_or_a_network_one_line_says_what_to_fetch_and_where(clone):
    port = closed_port()
    result = make(clone, ".comfyui-033/.ready", f"http://127.0.0.1:{port}")
    assert result.returncode != 0
    archive = clone / ".sources" / "downloads" / COMFY.archive_name
    [line] = [line for line in said(result) if "could not download" in line]
    assert line.startswith(f"sources: could not download http://127.0.0.1:{port}/{COMFY.archive_name} (")
    assert line.endswith(f"download {COMFY.url} and put it at {archive} "
                         f"(or give ../shared/{COMFY.shared} beside this clone)")
    assert not (clone / ".comfyui-033").exists() and not archive.exists()
    assert list((clone / ".sources" / "downloads").iterdir()) == []  # no partial download left


@needs_shared
@pytest.mark.parametrize("how", ["placed", "served"])
def test_an_archive_with_other_bytes_is_refused(clone, tmp_path, how):
    changed = "nodes.py"
    folder = clone / ".sources" / "downloads" if how == "placed" else tmp_path / "served"
    folder.mkdir(parents=True)
    github_archive(GGUF, folder / GGUF.archive_name, change=changed)
    handler = functools.partial(QuietHandler, directory=str(tmp_path / "served"))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            result = make(clone, ".sources/third_party/ComfyUI-GGUF.ready",
                          f"http://127.0.0.1:{server.server_address[1]}")
        finally:
            server.shutdown()
    assert result.returncode != 0
    archive = clone / ".sources" / "downloads" / GGUF.archive_name
    [line] = [line for line in said(result) if "is not the recorded tree" in line]
    assert line.startswith(f"sources: ComfyUI-GGUF from {archive} is not the recorded tree (digest ")
    assert line.endswith(f"download {GGUF.url} and put it at {archive} "
                         f"(or give ../shared/{GGUF.shared} beside this clone)")
    assert not (clone / ".sources" / "third_party" / "ComfyUI-GGUF").exists()
    # A placed archive is the user's: kept. A downloaded one goes, so the next run fetches again.
    assert archive.exists() == (how == "placed")


def test_an_archive_that_is_no_tarball_is_refused(clone):
    downloads = clone / ".sources" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / GGUF.archive_name).write_bytes(b"<html>rate limited</html>")
    result = make(clone, ".sources/third_party/ComfyUI-GGUF.ready", f"http://127.0.0.1:{closed_port()}")
    assert result.returncode != 0
    [line] = said(result)
    assert "is not a readable .tar.gz" in line and not (clone / ".sources" / "third_party" / "ComfyUI-GGUF").exists()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

"""bench/gpu_carry.py: what a device call carries and brings back, against the device tool's
limits (a rehearsal relies on these checks to say a call would come back whole)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_carry  # noqa: E402


def _files(root: Path, names: list[str], size: int = 10) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)


def test_what_comes_back_whole_passes(tmp_path):
    _files(tmp_path, ["summary.json", "rows.jsonl", "a/b/two_down.log", "extra.tar.gz"])
    verdict = gpu_carry.comeback(tmp_path)
    assert verdict["ok"], verdict
    assert len(verdict["files"]) == 4 and verdict["total_bytes"] == 40


def test_each_limit_of_what_comes_back_is_named(tmp_path):
    _files(tmp_path / "many", [f"f{i}.log" for i in range(9)])
    assert any("9 files" in p for p in gpu_carry.comeback(tmp_path / "many")["problems"])
    _files(tmp_path / "deep", ["a/b/c/three_down.log"])
    assert any("folders down" in p for p in gpu_carry.comeback(tmp_path / "deep")["problems"])
    _files(tmp_path / "name", ["odd name.log"])
    assert any("characters" in p for p in gpu_carry.comeback(tmp_path / "name")["problems"])
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "huge.log", "wb") as f:
        f.truncate(gpu_carry.MAX_FILE_BYTES + 1)  # sparse: no 16 MiB written
    assert any("over 16 MiB" in p for p in gpu_carry.comeback(big)["problems"])
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "to_big").symlink_to(big / "huge.log")
    assert any("not a plain file" in p for p in gpu_carry.comeback(tmp_path / "link")["problems"])


def _wheel(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.split('-')[0]}/__init__.py", "VALUE = 1\n")
    return path


def test_unpack_takes_the_wheels_this_python_imports_and_names_the_others(tmp_path):
    pure = _wheel(tmp_path / "kit", "purepkg-1.0-py3-none-any.whl")
    other = _wheel(tmp_path / "kit", "otherpkg-1.0-cp299-cp299-manylinux2014_x86_64.whl")
    verdict = gpu_carry.unpack([pure, other], tmp_path / "site")
    assert verdict["unpacked"] == [pure.name] and verdict["skipped_other_python"] == [other.name]
    assert (tmp_path / "site" / "purepkg" / "__init__.py").is_file()
    assert not (tmp_path / "site" / "otherpkg").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (what a call carries is git's list)")
def test_carried_counts_the_checkout_and_the_kit_and_refuses_bytecode_and_other_pythons(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text(".gpu_kit/\nignored.txt\n")
    _files(repo, ["tracked.py"], 1000)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    _files(repo, ["untracked.py"], 300)
    _files(repo, ["ignored.txt"], 5000)
    _wheel(repo / ".gpu_kit" / "wheels", "fine-1.0-cp312-cp312-manylinux2014_x86_64.whl")
    verdict = gpu_carry.carried(repo, [".gpu_kit"])
    assert verdict["ok"], verdict
    assert verdict["bytes"]["tracked"] == 1000 + len(".gpu_kit/\nignored.txt\n")
    assert verdict["bytes"]["untracked_not_ignored"] == 300 and verdict["bytes"][".gpu_kit"] > 0
    assert "ignored.txt" not in str(verdict)

    _wheel(repo / ".gpu_kit" / "wheels", "stale-1.0-cp311-cp311-manylinux2014_x86_64.whl")
    _files(repo / ".gpu_kit", ["tree/__pycache__/m.cpython-311.pyc"])
    problems = gpu_carry.carried(repo, [".gpu_kit", ".missing"])["problems"]
    assert any("stale-1.0-cp311" in p and "cp312" in p for p in problems), problems
    assert any("bytecode" in p for p in problems), problems
    assert any(".missing" in p for p in problems), problems
    with open(repo / "untracked.bin", "wb") as f:
        f.truncate(gpu_carry.MAX_CARRIED_BYTES)
    assert any("would travel" in p for p in gpu_carry.carried(repo, [])["problems"])

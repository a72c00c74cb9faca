"""What travels to the GPU machine and what comes back from it (bench/gpu_session.sh).

Three jobs, one per subcommand, all about the limits of a GPU machine that takes a copy of the
checkout and gives back what a command leaves in $OUT:
  unpack    the kit's wheels that this interpreter can import, unzipped onto one folder for
            PYTHONPATH: no pip, no dependency resolution, the image's own packages (its CUDA
            torch above all) untouched. A wheel built for another Python is skipped and named
            (a rehearsal on this machine's Python; on the device every wheel must fit).
  comeback  whether what a call left under $OUT comes back whole: at most 8 files, each at most
            16 MiB and 64 MiB together, no more than 2 folders down, names of letters, digits,
            '.', '_' and '-' alone, plain files only.
  carried   what a call from a checkout would carry: its tracked files, the untracked ones git
            does not ignore, shared/ if present, and the carried paths; at most 64 MiB, no
            bytecode in a carried path (it travels as it is), and every compiled wheel of the
            kit built for the device's Python (3.12).
Each prints a JSON verdict; the exit status is 1 where a limit is broken.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

MiB = 1 << 20
MAX_FILES = 8
MAX_FILE_BYTES = 16 * MiB
MAX_BACK_BYTES = 64 * MiB
MAX_FOLDERS_DOWN = 2
MAX_CARRIED_BYTES = 64 * MiB
DEVICE_PYTHON = "cp312"
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


# ------------------------------------------------------------------ unpack
def wheel_tags(filename: str) -> set[tuple[str, str, str]]:
    """(python, abi, platform) tags a wheel's file name declares (compressed tag sets expanded)."""
    parts = Path(filename).name[:-len(".whl")].split("-")
    py, abi, plat = parts[-3:]
    return {(p, a, pl) for p in py.split(".") for a in abi.split(".") for pl in plat.split(".")}


def fits_interpreter(filename: str) -> bool:
    """Whether the running interpreter can import the wheel (its tags meet this one's)."""
    from packaging.tags import sys_tags
    supported = {(t.interpreter, t.abi, t.platform) for t in sys_tags()}
    return bool(wheel_tags(filename) & supported)


def unpack(wheels: list[Path], site: Path) -> dict[str, Any]:
    site.mkdir(parents=True, exist_ok=True)
    unpacked, skipped = [], []
    for wheel in wheels:
        if fits_interpreter(wheel.name):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
            unpacked.append(wheel.name)
        else:
            skipped.append(wheel.name)
    return {"site": str(site), "unpacked": unpacked, "skipped_other_python": skipped,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


# ------------------------------------------------------------------ comeback
def comeback(out: Path) -> dict[str, Any]:
    files, problems = [], []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{rel}: not a plain file or folder")
            continue
        if not all(NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_', '-'")
        if path.is_dir():
            continue
        size = path.stat().st_size
        files.append({"path": str(rel), "bytes": size})
        if len(rel.parts) - 1 > MAX_FOLDERS_DOWN:
            problems.append(f"{rel}: more than {MAX_FOLDERS_DOWN} folders down")
        if size > MAX_FILE_BYTES:
            problems.append(f"{rel}: {size / MiB:.1f} MiB, over {MAX_FILE_BYTES // MiB} MiB")
    total = sum(f["bytes"] for f in files)
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, over {MAX_FILES}")
    if total > MAX_BACK_BYTES:
        problems.append(f"{total / MiB:.1f} MiB in all, over {MAX_BACK_BYTES // MiB} MiB")
    return {"ok": not problems, "files": files, "total_bytes": total, "problems": problems}


# ------------------------------------------------------------------ carried
def _git_files(repo: Path, *args: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", *args], cwd=repo, check=True,
                         capture_output=True).stdout
    return [repo / name for name in out.decode().split("\0") if name]


def _walk(path: Path) -> list[Path]:
    if path.is_symlink() or path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_symlink() or p.is_file()]


def carried(repo: Path, carry: list[str]) -> dict[str, Any]:
    problems: list[str] = []
    groups: dict[str, list[Path]] = {
        "tracked": _git_files(repo),
        "untracked_not_ignored": _git_files(repo, "--others", "--exclude-standard"),
    }
    if (repo / "shared").is_dir():
        groups["shared"] = _walk(repo / "shared")
    for path in carry:
        full = repo / path
        if not full.exists():
            problems.append(f"{path}: carried but not here (tools/gpu_kit.sh builds the kit)")
            groups[path] = []
            continue
        groups[path] = _walk(full)
        caches = sorted({str(p.relative_to(repo)) for p in groups[path] if "__pycache__" in p.parts})
        if caches:
            problems.append(f"{path}: bytecode would travel ({caches[0]} and {len(caches) - 1} more)")
        for wheel in (p for p in groups[path] if p.name.endswith(".whl")):
            pythons = {py for py, _, _ in wheel_tags(wheel.name)}
            if not pythons & {"py3", "py2", DEVICE_PYTHON} and not any(
                    abi == "abi3" for _, abi, _ in wheel_tags(wheel.name)):
                problems.append(f"{wheel.relative_to(repo)}: built for {sorted(pythons)}, "
                                f"not the device's {DEVICE_PYTHON}")
    sizes = {name: sum(p.lstat().st_size for p in paths if p.exists() or p.is_symlink())
             for name, paths in groups.items()}
    total = sum(sizes.values())
    if total > MAX_CARRIED_BYTES:
        problems.append(f"{total / MiB:.1f} MiB would travel, over {MAX_CARRIED_BYTES // MiB} MiB")
    return {"ok": not problems, "repo": str(repo), "carry": carry,
            "bytes": sizes, "mib": {name: round(size / MiB, 2) for name, size in sizes.items()},
            "total_mib": round(total / MiB, 2), "limit_mib": MAX_CARRIED_BYTES // MiB,
            "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    u = sub.add_parser("unpack", help="unzip the wheels this Python can import onto SITE")
    u.add_argument("--site", type=Path, required=True)
    u.add_argument("wheels", type=Path, nargs="*")
    c = sub.add_parser("comeback", help="check what $OUT holds against the limits")
    c.add_argument("out", type=Path)
    t = sub.add_parser("carried", help="measure what a call from REPO carrying PATHs would send")
    t.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    t.add_argument("--carry", action="append", default=[])
    args = ap.parse_args(argv)
    if args.command == "unpack":
        verdict = unpack(args.wheels, args.site)
        ok = True
    elif args.command == "comeback":
        verdict = comeback(args.out)
        ok = verdict["ok"]
    else:
        verdict = carried(args.repo, args.carry)
        ok = verdict["ok"]
    print(json.dumps(verdict))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

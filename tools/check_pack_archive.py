"""Check the archive `comfy node pack` made before it can be published (`make pack-check`).

The registry archive is the git-tracked files less .comfyignore. It must hold what a user runs
and nothing of the repository's development: no tests, benchmarks, tools or CI files; the entry
point, the license, the README with the pages it links (docs/, ARCHITECTURE.md: an installed copy
reads the same manual as GitHub) and the package metadata; every tracked file of the folders the
pack runs from or documents itself in; every module a shipped module imports (relative imports, followed from the files
themselves, so a module added without being tracked or one .comfyignore drops is caught); every
file the frontend extension imports; the locales and help pages the frontend reads; and every
relative link and image of its Markdown pages, which must lead to a file of the archive; and the
registry's icon, an image of the archive.

usage: python tools/check_pack_archive.py node.zip   (run in the repository; exit 1 on problems)
"""
from __future__ import annotations

import ast
import json
import posixpath
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

DEVELOPMENT = ("tests/", "bench/", "tools/", ".ci/", "Makefile", ".gitignore", ".comfyignore")
REQUIRED = ("__init__.py", "LICENSE", "README.md", "ARCHITECTURE.md", "pyproject.toml", "requirements.txt")
SHIPPED_FOLDERS = ("nodes/", "offload_core/", "web/", "locales/", "example_workflows/", "docs/")
NOT_RUN = ("web/screenshot.json",)   # the README picture's record: the frontend never loads it
LANGUAGES = ("en", "zh")
LOCALE_FILES = ("main.json", "nodeDefs.json", "settings.json", "commands.json")
JS_IMPORT = re.compile(r"""(?:\bfrom\s*|\bimport\s*\(\s*|\bimport\s+|new URL\(\s*)["'](\.{1,2}/[^"']+)["']""")


def problems(files: dict[str, bytes], tracked: list[str]) -> list[str]:
    """Everything wrong with an archive of `files` (name -> bytes) made from `tracked`."""
    found = []
    names = set(files)
    found += [f"development file in the archive: {n}" for n in sorted(names)
              if any(n == d or n.startswith(d) for d in DEVELOPMENT)]
    found += [f"missing: {n}" for n in REQUIRED if n not in names]
    found += [f"tracked but not in the archive: {n}" for n in tracked
              if n.startswith(SHIPPED_FOLDERS) and n not in NOT_RUN and n not in names]
    for name in sorted(n for n in names if n.endswith(".py")):
        found += python_imports(name, files)
    web = web_directory(files)
    for name in sorted(n for n in names if n.startswith(web) and n.endswith(".js")):
        found += js_imports(name, files, web)
    found += locales_and_help(files, web)
    found += dead_links(files)
    found += registry_icon(files)
    return found


def registry_icon(files: dict[str, bytes]) -> list[str]:
    """The registry shows the pack under ``[tool.comfy] Icon``: an address of an image of this
    archive on the repository's main branch (so the address lives as long as the file does)."""
    try:
        meta = tomllib.loads(files.get("pyproject.toml", b"").decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return [f"pyproject.toml cannot be read: {e}"]
    icon = meta.get("tool", {}).get("comfy", {}).get("Icon", "")
    repo = meta.get("project", {}).get("urls", {}).get("Repository", "")
    prefix = repo.replace("https://github.com/", "https://raw.githubusercontent.com/", 1).rstrip("/") + "/main/"
    if not icon:
        return ["pyproject.toml: [tool.comfy] Icon is empty (the registry shows no icon)"]
    if not repo.startswith("https://github.com/") or not icon.startswith(prefix):
        return [f"pyproject.toml: Icon {icon} is not a file of {repo}'s main branch"]
    path = icon[len(prefix):]
    if path not in files or not path.endswith((".svg", ".png", ".jpg", ".webp")):
        return [f"pyproject.toml: Icon names {path}, not an image of the archive"]
    return []


MD_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""<(?:img|a|source)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def dead_links(files: dict[str, bytes]) -> list[str]:
    """Relative links and images of the archive's Markdown pages (README, ARCHITECTURE, docs/ and
    the help pages) whose target the archive lacks: an installed copy must read whole."""
    out = []
    for name in sorted(n for n in files if n.endswith(".md")):
        text = CODE.sub("", files[name].decode("utf-8"))
        for target in MD_LINK.findall(text) + HTML_LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith(("#", "/")):
                continue  # a web address, an anchor of the page itself, a path of the server's
            path = posixpath.normpath(posixpath.join(posixpath.dirname(name), target.split("#")[0]))
            if path.startswith("../") or (path not in files and not any(f.startswith(path + "/") for f in files)):
                out.append(f"{name} links to {target}: not in the archive")
    return out


def python_imports(name: str, files: dict[str, bytes]) -> list[str]:
    """The relative imports of one module that resolve to nothing in the archive, and absolute
    imports of the repository's development folders."""
    tree = ast.parse(files[name], filename=name)
    # A module's package is its folder; a package's __init__ is in its own folder too.
    package = posixpath.dirname(name).split("/") if posixpath.dirname(name) else []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{name} imports {a.name}, a development folder" for a in node.names
                    if a.name.split(".")[0] in ("tests", "bench", "tools")]
        elif isinstance(node, ast.ImportFrom) and node.level:
            if node.level - 1 > len(package):
                out.append(f"{name}: relative import above the pack's root")
                continue
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            if node.module and not _module_in(target, files):
                out.append(f"{name} imports {'.' * node.level}{node.module}: not in the archive")
                continue
            for alias in node.names:
                if alias.name == "*" or _module_in(target + [alias.name], files):
                    continue
                if not _binds(target, alias.name, files):
                    out.append(f"{name} imports {alias.name} from {'.' * node.level}{node.module or ''}: "
                               "not in the archive")
    return out


def _module_in(parts: list[str], files: dict[str, bytes]) -> bool:
    path = "/".join(parts)
    return f"{path}.py" in files or f"{path}/__init__.py" in files if path else "__init__.py" in files


def _binds(package: list[str], attribute: str, files: dict[str, bytes]) -> bool:
    """Whether a module (or package's __init__) of the archive defines or imports `attribute`."""
    path = "/".join(package)
    source = files.get(f"{path}.py" if path else "__init__.py") or files.get(f"{path}/__init__.py")
    if source is None:
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attribute:
            return True
        # `from . import x` binds x only where the submodule x exists: that is checked itself.
        own_submodule = isinstance(node, ast.ImportFrom) and node.level and not node.module
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not own_submodule and any(
                (a.asname or a.name.split(".")[0]) == attribute for a in node.names):
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if attribute in _bound_names(targets):
                return True
    return False


def _bound_names(targets: list[ast.expr]) -> set[str]:
    """The names an assignment binds, unpacking included (`A, B = ...`, `A, *B = ...`)."""
    names = set()
    for target in targets:
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Starred):
            names |= _bound_names([target.value])
        elif isinstance(target, (ast.Tuple, ast.List)):
            names |= _bound_names(target.elts)
    return names


def web_directory(files: dict[str, bytes]) -> str:
    """The entry point's WEB_DIRECTORY, as a folder prefix of archive names."""
    for node in ast.walk(ast.parse(files.get("__init__.py", b""))):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "WEB_DIRECTORY"
                                                for t in node.targets):
            return posixpath.normpath(node.value.value).strip("/") + "/"
    return "web/"


def js_imports(name: str, files: dict[str, bytes], web: str) -> list[str]:
    """The files one frontend module imports (or loads by URL) from the pack that the archive
    lacks; paths that leave the web directory are the frontend's own (../../scripts/app.js)."""
    out = []
    for target in JS_IMPORT.findall(files[name].decode("utf-8")):
        path = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
        if path.startswith(web) and path not in files:
            out.append(f"{name} imports {target}: not in the archive")
    return out


def locales_and_help(files: dict[str, bytes], web: str) -> list[str]:
    """Every locale file in both languages, valid JSON; a help page for every node they name."""
    out = []
    nodes: set[str] = set()
    for lang in LANGUAGES:
        for file in LOCALE_FILES:
            name = f"locales/{lang}/{file}"
            if name not in files:
                out.append(f"missing: {name}")
                continue
            try:
                data = json.loads(files[name])
            except ValueError as e:
                out.append(f"{name} is not JSON: {e}")
                continue
            if file == "nodeDefs.json":
                nodes |= set(data)
    for node in sorted(nodes):
        for page in (f"{web}docs/{node}.md", f"{web}docs/{node}/zh.md"):
            if page not in files:
                out.append(f"missing help page: {page}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with zipfile.ZipFile(argv[1]) as archive:
        files = {n: archive.read(n) for n in archive.namelist() if not n.endswith("/")}
    # One name per NUL: a name may hold spaces (the example workflows' do), as comfy-cli reads it.
    tracked = [name for name in subprocess.run(
        ["git", "ls-files", "-z"], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parent.parent).stdout.split("\0") if name]
    found = problems(files, tracked)
    for line in found:
        print(f"pack archive: {line}", file=sys.stderr)
    if not found:
        print(f"pack archive: {argv[1]} holds {len(files)} files, what the pack runs and nothing else")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

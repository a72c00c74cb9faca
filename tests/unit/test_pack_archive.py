"""tools/check_pack_archive.py, the check of the registry archive `make pack-check` runs: the
repository's own files, as `comfy node pack` would put them in (tracked, less .comfyignore), pass;
each kind of fault is found.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import check_pack_archive as check  # noqa: E402


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # The files of this change that are not committed yet are part of the pack as well. One name
    # per NUL: a name may hold spaces (the example workflows' do).
    extra = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sorted(name for name in set(out.stdout.split("\0")) | set(extra) if name)


@pytest.fixture
def archive(tracked) -> dict[str, bytes]:
    """What the archive holds: the tracked files less .comfyignore's development files."""
    return {name: (ROOT / name).read_bytes() for name in tracked
            if not any(name == d or name.startswith(d) for d in check.DEVELOPMENT)
            and name not in check.NOT_RUN and (ROOT / name).is_file()}


def test_the_repositorys_archive_passes(archive, tracked):
    assert check.problems(archive, tracked) == []
    assert "locales/zh/nodeDefs.json" in archive and "web/docs/ApplyLayerwiseOffload/zh.md" in archive


def test_a_development_file_is_found(archive, tracked):
    archive["tests/test_panel.py"] = b""
    archive["Makefile"] = b""
    assert check.problems(archive, tracked) == ["development file in the archive: Makefile",
                                                "development file in the archive: tests/test_panel.py"]


def test_a_module_the_pack_imports_is_missing(archive, tracked):
    del archive["nodes/server/routes.py"]
    found = check.problems(archive, tracked)
    assert "tracked but not in the archive: nodes/server/routes.py" in found
    assert any(p.startswith("nodes/__init__.py imports routes") for p in found), found


def test_an_untracked_module_the_pack_imports_is_found(archive, tracked):
    """A module imported but never added to git: the file list alone would not show it."""
    del archive["offload_core/units.py"]
    found = check.problems(archive, [t for t in tracked if t != "offload_core/units.py"])
    assert found and all("units" in p for p in found), found


def test_an_import_of_a_development_folder_is_found(archive, tracked):
    archive["nodes/core/budgets.py"] += b"\nimport tests.workflows\n"
    assert check.problems(archive, tracked) == [
        "nodes/core/budgets.py imports tests.workflows, a development folder"]


def test_a_frontend_module_the_extension_imports_is_missing(archive, tracked):
    del archive["web/i18n.js"]
    found = check.problems(archive, tracked)
    assert "web/panel.js imports ./i18n.js: not in the archive" in found, found
    assert "web/tiered_offload.js imports ./i18n.js: not in the archive" in found, found


def test_locales_and_help_pages_are_checked(archive, tracked):
    del archive["locales/zh/settings.json"]
    del archive["web/docs/ModelLevelSwap/zh.md"]
    archive["locales/en/main.json"] = b"{not json"
    found = check.problems(archive, tracked)
    assert "missing: locales/zh/settings.json" in found
    assert "missing help page: web/docs/ModelLevelSwap/zh.md" in found
    assert any(p.startswith("locales/en/main.json is not JSON") for p in found), found


def test_a_dropped_manual_page_is_found(archive, tracked):
    """The README links docs/ and ARCHITECTURE.md: an installed copy must hold them too."""
    del archive["docs/api.md"]
    del archive["ARCHITECTURE.md"]
    found = check.problems(archive, tracked)
    assert found[:2] == ["missing: ARCHITECTURE.md", "tracked but not in the archive: docs/api.md"], found
    # and every page that links them says so
    assert found[2:] and all(re.search(r"links to \S*(api\.md|ARCHITECTURE\.md)\S*: not in the archive$", p)
                             for p in found[2:]), found


def test_names_bound_by_unpacking_count_as_defined(archive, tracked):
    """`A, B = ...` defines A and B: an import of them resolves; one of a name it lacks does not."""
    archive["nodes/core/budgets.py"] += b"\nFIRST, (SECOND, *REST) = 1, (2, 3)\n"
    archive["nodes/core/state.py"] += b"\nfrom .budgets import FIRST, SECOND, REST\n"
    assert check.problems(archive, tracked) == []
    archive["nodes/core/state.py"] += b"from .budgets import THIRD\n"
    assert check.problems(archive, tracked) == [
        "nodes/core/state.py imports THIRD from .budgets: not in the archive"]


def test_a_link_or_image_the_archive_lacks_is_found(archive, tracked):
    """A page of the manual that links a development folder, or shows an image left out of the
    archive, reads broken in an installed copy: each is named."""
    archive["docs/benchmarks-extra.md"] = (b"See [the bench](../bench/layerwise.py), "
                                           b"![shot](../web/missing.png), <img src=\"../tests/x.png\">, "
                                           b"[ok](panel.md#the-panel), [web](https://example.com), `[code](../bench/x)`.")
    tracked = sorted([*tracked, "docs/benchmarks-extra.md"])
    found = check.problems(archive, tracked)
    assert found == ["docs/benchmarks-extra.md links to ../bench/layerwise.py: not in the archive",
                     "docs/benchmarks-extra.md links to ../web/missing.png: not in the archive",
                     "docs/benchmarks-extra.md links to ../tests/x.png: not in the archive"], found


def test_an_icon_the_archive_lacks_is_found(archive, tracked):
    """The registry's icon is an image of the archive, addressed on the repository's main branch."""
    assert check.registry_icon(archive) == []
    meta = archive["pyproject.toml"].decode()
    for icon, fragment in (('""', "Icon is empty"),
                           ('"https://example.com/icon.svg"', "not a file of"),
                           ('"https://raw.githubusercontent.com/comfyui-tiered-offload/comfyui-tiered-offload/main/web/gone.svg"',
                            "not an image of the archive")):
        changed = dict(archive, **{"pyproject.toml": re.sub(r'^Icon = .*$', f"Icon = {icon}", meta,
                                                            flags=re.MULTILINE).encode()})
        found = check.problems(changed, tracked)
        assert any(fragment in p for p in found), found

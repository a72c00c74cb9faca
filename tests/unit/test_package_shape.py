"""The pack's import graph keeps its shape (ARCHITECTURE.md): no import circle, an engine that never
imports ComfyUI, engine rooms whose imports only point down, rooms of the ComfyUI side (nodes/)
whose imports point one way (server -> node families -> core -> engine, no family importing
another), no module reaching into another's private names, and the process-wide registries of the
ComfyUI side in one module. No line count limits a class: a class is as large as its one idea.

Read from the source with `ast` (nothing is imported), over the root `__init__.py`, `nodes/` and
`offload_core/`; imports inside functions and under `TYPE_CHECKING` count as well, since a lazy
import is still an arrow between two modules.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nodes", "offload_core")
ENGINE = "offload_core"
# What the engine may import besides the standard library and itself.
ENGINE_THIRD_PARTY = {"torch", "safetensors", "psutil"}
# The engine's rooms and the rooms each may import (offload_core/*/__init__.py says the same in
# words). Modules at the engine's top level are rooms of their own. The package's __init__ is its
# public API and may import any room.
ENGINE_ROOMS = {
    "units": set(),
    "alignment": set(),
    "per_module": set(),
    "ordering": set(),
    "files": {"alignment"},
    "host": {"alignment", "ordering", "units"},
    "sharing": {"host", "units"},
    "blocks": {"host", "ordering"},
    "device": {"host", "ordering", "units"},
    "disk": {"alignment", "files", "host", "device", "ordering", "units"},
    "layerwise": {"alignment", "blocks", "device", "disk", "host", "ordering", "sharing", "units"},
    "models": {"files", "host", "ordering", "sharing", "units"},
}
NODES = "nodes"
# The ComfyUI side's rooms and the rooms of nodes/ each may import (nodes/*/__init__.py says the
# same in words); every room may import the engine as well. nodes/__init__.py lists the nodes and
# wires the server at start-up: it may import every room. A module at nodes/ top level is in no room.
NODE_FAMILIES = ("layerwise", "swap", "tiers")
NODE_ROOMS = {
    "core": set(),
    **{family: {"core"} for family in NODE_FAMILIES},
    "server": {*NODE_FAMILIES, "core"},
}
# The ComfyUI side's process-wide registries: created in nodes/core/state.py only.
REGISTRY_TYPES = {"PerModule", "TierManager", "PromptHolds", "LayerwiseRegistry"}
STATE_MODULE = "nodes.core.state"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted from the pack root ("" is the root __init__)
    target: str  # an absolute module name, dotted from the pack root when internal
    internal: bool
    line: int
    names: tuple[str, ...] = ()


def pack_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name (from the pack root) -> file, for the root __init__ and both packages."""
    found = {"": root / "__init__.py"}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _package_of(name: str, path: Path) -> list[str]:
    parts = name.split(".") if name else []
    return parts if path.name == "__init__.py" else parts[:-1]


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import statement of one module, anywhere in it, plus literal importlib.import_module
    calls; relative ones resolved to dotted names from the pack root."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, False, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            if node.level == 0:
                out.append(Import(name, node.module or "", False, node.lineno, names))
                continue
            package = _package_of(name, path)
            up = node.level - 1
            if up > len(package):
                out.append(Import(name, "<above the pack root>", True, node.lineno, names))
                continue
            base = package[:len(package) - up] + (node.module.split(".") if node.module else [])
            target = ".".join(base)
            submodules = [f"{target}.{n}" if target else n for n in names]
            if all(m in known for m in submodules):  # `from . import a, b`: arrows to a and b
                out += [Import(name, m, True, node.lineno) for m in submodules]
            else:
                out.append(Import(name, target, True, node.lineno, names))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and not node.args[0].value.startswith(".")):
            out.append(Import(name, node.args[0].value, False, node.lineno))
    return out


def graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    known = pack_modules(root)
    return known, [i for name, path in known.items() for i in imports(name, path, known)]


def circles(known: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing
    itself), each as a list of its modules: every import circle lies inside one."""
    arrows: dict[str, set[str]] = {m: set() for m in known}
    for e in edges:
        if e.internal and e.target in known and e.target != e.module:
            arrows[e.module].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def _shown(name: str) -> str:
    return name or "<root __init__>"


def _room(module: str) -> str | None:
    """The engine room of an engine module (None for the engine's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def engine_problems(known: dict[str, Path], edges: list[Import]) -> list[str]:
    """ComfyUI (or anything but the standard library, torch, safetensors and psutil) imported by
    the engine, relative imports that leave it, and arrows between rooms the table does not allow."""
    allowed_outside = set(sys.stdlib_module_names) | ENGINE_THIRD_PARTY | {"__future__"}
    problems = []
    for e in edges:
        if e.module != ENGINE and not e.module.startswith(ENGINE + "."):
            continue
        where = f"{e.module} (line {e.line})"
        if not e.internal:
            top = e.target.split(".")[0]
            if top not in allowed_outside:
                problems.append(f"{where} imports {e.target}: the engine imports only the standard "
                                f"library, {', '.join(sorted(ENGINE_THIRD_PARTY))} and itself")
            continue
        if e.target != ENGINE and not e.target.startswith(ENGINE + "."):
            problems.append(f"{where} imports {_shown(e.target)}, outside the engine")
            continue
        source, target = _room(e.module), _room(e.target)
        if source is None or target is None or source == target:
            continue
        if source not in ENGINE_ROOMS:
            problem = f"{e.module}: {source} is no room of the engine ({', '.join(ENGINE_ROOMS)})"
            if problem not in problems:
                problems.append(problem)
        elif target not in ENGINE_ROOMS[source]:
            problems.append(f"{where} imports {e.target}: {source} may import only "
                            f"{', '.join(sorted(ENGINE_ROOMS[source])) or 'nothing of the engine'}")
    return problems


def node_room_problems(known: dict[str, Path], edges: list[Import]) -> list[str]:
    """Modules of nodes/ outside every room, and arrows between its rooms that NODE_ROOMS does not
    allow: a node family importing another, core importing a family or the server, a family
    importing the server, a room importing nodes/__init__ or the pack root. The imports of the two
    __init__s above the rooms are not held to the table: they may import every room."""
    problems = []
    for name in known:
        parts = name.split(".")
        if parts[0] == NODES and len(parts) > 1 and parts[1] not in NODE_ROOMS:
            problems.append(f"{name}: {parts[1]} is no room of nodes/ ({', '.join(NODE_ROOMS)})")
    for e in edges:
        source, target = e.module.split("."), e.target.split(".")
        if not e.internal or source[0] != NODES or len(source) < 2 or source[1] not in NODE_ROOMS:
            continue
        if target[0] != NODES:
            if target[0] != ENGINE:
                problems.append(f"{e.module} (line {e.line}) imports {_shown(e.target)}: "
                                f"nodes/ imports only itself and the engine")
            continue
        room = source[1]
        into = target[1] if len(target) > 1 else "<nodes/__init__>"
        if into != room and into not in NODE_ROOMS[room]:
            problems.append(f"{e.module} (line {e.line}) imports {e.target}: {room} may import only "
                            f"{', '.join(sorted(NODE_ROOMS[room] | {ENGINE}))}")
    return problems


def private_reaches(known: dict[str, Path], edges: list[Import]) -> list[str]:
    """Imports of another module's private names (`from .x import _y`) and uses of them through a
    module imported whole (`x._y`)."""
    problems = []
    for e in edges:
        if e.internal and e.target in known and e.target != e.module:
            problems += [f"{_shown(e.module)} (line {e.line}) imports {n} from {e.target}"
                         for n in e.names if n.startswith("_") and not n.startswith("__")]
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                modules |= {alias.asname or alias.name for alias in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                problems.append(f"{_shown(name)} (line {node.lineno}) uses {node.value.id}.{node.attr}")
    return problems


# Private members the pack's code may read on objects not its own: torch's (a module's parameter
# and buffer tables, a tensor's version counter, its C bindings, the inductor's config), and a
# same-file friend class named in its docstring (module -> the friend's reaches).
TORCH_INTERNALS = {"_parameters", "_buffers", "_version", "_C", "_nn", "_parse_to", "_inductor"}
FRIENDS = {"offload_core.disk.host_cache": {"_entries", "_release"}}  # Lease, HostCache's friend


def object_reaches(known: dict[str, Path]) -> list[str]:
    """Reads or writes of another object's private members (``obj._x``, ``obj`` not ``self``,
    ``cls`` or ``super()``), but torch's and a named friend's."""
    problems = []
    for name, path in known.items():
        allowed = TORCH_INTERNALS | FRIENDS.get(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")) or node.attr in allowed:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            problems.append(f"{_shown(name)} (line {node.lineno}) reaches into {ast.unparse(node)}")
    return problems


def registries_outside_state(known: dict[str, Path]) -> list[str]:
    """Module-level registries of the ComfyUI side (PerModule, the tier manager...) made anywhere
    but nodes/core/state.py."""
    problems = []
    for name, path in known.items():
        if not name.startswith("nodes") or name == STATE_MODULE:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call):
                func = value.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if called in REGISTRY_TYPES:
                    problems.append(f"{name} (line {node.lineno}) creates a {called}: process-wide "
                                    f"state lives in {STATE_MODULE}")
    return problems


def test_no_import_circle():
    known, edges = graph()
    found = circles(known, edges)
    assert not found, "import circles: " + "; ".join(" <-> ".join(map(_shown, c)) for c in found)


def test_engine_imports_no_comfyui_and_its_rooms_point_down():
    known, edges = graph()
    problems = engine_problems(known, edges)
    assert not problems, "\n".join(problems)


def test_node_rooms_import_one_way():
    known, edges = graph()
    problems = node_room_problems(known, edges)
    assert not problems, "\n".join(problems)


def test_no_module_reaches_into_another_s_private_names():
    known, edges = graph()
    problems = private_reaches(known, edges)
    assert not problems, "\n".join(problems)


def test_no_object_reaches_into_another_s_private_members():
    problems = object_reaches(pack_modules())
    assert not problems, "\n".join(problems)


def test_process_state_lives_in_one_module():
    problems = registries_outside_state(pack_modules())
    assert not problems, "\n".join(problems)


def test_each_engine_room_says_what_it_is_for_and_may_import():
    """Every room's __init__ is a docstring of its job and its allowed imports, and nothing else."""
    for room in ENGINE_ROOMS:
        init = ROOT / ENGINE / room / "__init__.py"
        if not init.exists():
            assert (ROOT / ENGINE / f"{room}.py").exists(), f"no room {room} in the engine"
            continue
        tree = ast.parse(init.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        assert doc and "May import" in doc, f"{init} must say what the room is for and may import"
        mentioned = {r for r in ENGINE_ROOMS if r in doc.split("May import", 1)[1]}
        assert ENGINE_ROOMS[room] <= mentioned, f"{init} must name {sorted(ENGINE_ROOMS[room])}"


def test_each_node_room_says_what_it_is_for_and_may_import():
    """Every room of nodes/ is a package whose __init__ is a docstring of its job and of the rooms
    it may import, and nothing else (so importing one module of a room runs no other)."""
    for room in NODE_ROOMS:
        init = ROOT / NODES / room / "__init__.py"
        assert init.exists(), f"no room {room} in nodes/"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        assert doc and "May import" in doc, f"{init} must say what the room is for and may import"
        assert len(tree.body) == 1, f"{init} must hold its docstring only"
        mentioned = {r for r in NODE_ROOMS if r in doc.split("May import", 1)[1]}
        assert NODE_ROOMS[room] <= mentioned, f"{init} must name {sorted(NODE_ROOMS[room])}"


def test_the_rooms_check_names_a_forbidden_import(tmp_path):
    """A node family importing another, core importing a family, a family importing the server,
    a module outside every room and an import of the pack root are each named; the arrows the
    table allows pass."""
    for package in (NODES, ENGINE, *(f"{NODES}/{room}" for room in NODE_ROOMS)):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("from .nodes.server import routes\n")
    (tmp_path / ENGINE / "units.py").write_text("")
    (tmp_path / NODES / "__init__.py").write_text("from .swap import node\nfrom .server import routes\n")
    (tmp_path / NODES / "core" / "state.py").write_text("from ...offload_core import units\n")
    (tmp_path / NODES / "core" / "models.py").write_text("def late():\n    from ..tiers import loaders\n")
    (tmp_path / NODES / "swap" / "node.py").write_text(
        "from ..core import state\nfrom ...offload_core.units import GIB\nfrom ..layerwise import session\n")
    (tmp_path / NODES / "layerwise" / "session.py").write_text("from ..server.routes import register\n")
    (tmp_path / NODES / "tiers" / "loaders.py").write_text(
        "from .. import core\nfrom ... import nodes\nfrom ... import comfy_entrypoint\n")
    (tmp_path / NODES / "server" / "routes.py").write_text(
        "from ..tiers import loaders\nfrom ..swap import node\nfrom ..core import state\n")
    (tmp_path / NODES / "helpers.py").write_text("from .core import state\n")
    known, edges = graph(tmp_path)
    assert node_room_problems(known, edges) == [
        "nodes.helpers: helpers is no room of nodes/ (core, layerwise, swap, tiers, server)",
        "nodes.core.models (line 2) imports nodes.tiers.loaders: core may import only offload_core",
        "nodes.layerwise.session (line 1) imports nodes.server.routes: layerwise may import only "
        "core, offload_core",
        "nodes.swap.node (line 3) imports nodes.layerwise.session: swap may import only core, offload_core",
        "nodes.tiers.loaders (line 2) imports nodes: tiers may import only core, offload_core",
        "nodes.tiers.loaders (line 3) imports <root __init__>: nodes/ imports only itself and the engine",
    ]


def test_the_checks_see_what_they_look_for(tmp_path):
    """Each check fails on a tree built to break it (a check that cannot fail asserts nothing)."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("from .nodes import a\n")
    (tmp_path / "nodes" / "a.py").write_text("from . import b\nfrom .c import _hidden\n")
    (tmp_path / "nodes" / "b.py").write_text(
        "def later():\n    from .a import x\nfrom ..offload_core.per_module import PerModule\n"
        "SESSIONS = PerModule()\n")
    (tmp_path / "nodes" / "c.py").write_text(
        "from ..offload_core.host import packing\npacking._peek()\n_hidden = 1\n")
    (tmp_path / "offload_core" / "host").mkdir()
    (tmp_path / "offload_core" / "host" / "__init__.py").write_text('"""Host."""\n')
    (tmp_path / "offload_core" / "host" / "packing.py").write_text(
        "import comfy.model_management\nfrom ..device import slots\n")
    (tmp_path / "offload_core" / "device").mkdir()
    (tmp_path / "offload_core" / "device" / "__init__.py").write_text("")
    (tmp_path / "offload_core" / "device" / "slots.py").write_text(
        "import importlib\nimportlib.import_module('folder_paths')\n"
        "class Ring:\n    def go(self, other):\n        self._mine = other._theirs\n        m._parameters\n")
    known, edges = graph(tmp_path)
    assert circles(known, edges) == [["nodes.a", "nodes.b"]]
    engine = "\n".join(engine_problems(known, edges))
    assert "imports comfy.model_management" in engine and "imports folder_paths" in engine
    assert "host may import only alignment, ordering, units" in engine
    private = "\n".join(private_reaches(known, edges))
    assert "imports _hidden from nodes.c" in private and "uses packing._peek" in private
    reaches = object_reaches(known)
    assert sorted(reaches) == ["nodes.c (line 2) reaches into packing._peek",
                               "offload_core.device.slots (line 5) reaches into other._theirs"]
    assert registries_outside_state(known) == [
        "nodes.b (line 4) creates a PerModule: process-wide state lives in nodes.core.state"]

"""The documentation's links hold, and the README stays a front page.

Every relative link in README.md, ARCHITECTURE.md and docs/ must name a file of the repository
that GitHub shows (tracked, or new and not ignored: a link into tests/artifacts/ works only on the
machine that wrote it), and every `#anchor` a heading of its page by GitHub's rules for heading
anchors. The README's first screen must hold what a newcomer looks for first: the install, the
two commands and the table of which node to use. Each check also runs on a page with the fault put
in, so a checker that finds nothing fails here too.
"""
from __future__ import annotations

import ast
import posixpath
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Callable
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
FIRST_SCREEN = 50   # lines: what a reader sees of the README without scrolling far
NODE_PAGES = ("docs/layerwise-offload.md", "docs/model-level-swap.md", "docs/tiered-loaders.md",
              "docs/vram-tier-manager.md")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HTML_ANCHOR = re.compile(r"""<a\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)   # http:, https:, mailto: ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks: a link in a code sample is not a link."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text in lower case, without punctuation
    (letters, digits, `_`, `-` and spaces stay), spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a page: its headings' (a repeated heading gets -1, -2, ... as on GitHub)
    and those of HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        found |= set(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of a page, outside code."""
    out = []
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        targets = INLINE_LINK.findall(line) + HTML_LINK.findall(line)
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append(definition.group(1))
        out += [(number, target) for target in targets]
    return out


def link_problems(page: str, text: str, files: set[str], read: Callable[[str], str]) -> list[str]:
    """What is broken among one page's relative links: a file the repository does not have, a
    link above the repository's root, an anchor no heading of the target page makes."""
    found = []
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        path = unquote(path)
        name = posixpath.normpath(posixpath.join(posixpath.dirname(page), path)) if path else page
        where = f"{page}:{number}: {target}"
        if name == ".." or name.startswith("../"):
            found.append(f"{where}: leaves the repository")
            continue
        is_folder = any(f.startswith(name.rstrip("/") + "/") for f in files)
        if name not in files and not is_folder:
            found.append(f"{where}: no such file in the repository")
            continue
        if anchor and name.endswith(".md") and unquote(anchor) not in anchors(read(name)):
            found.append(f"{where}: no heading makes the anchor #{anchor}")
    return found


def first_screen_problems(readme: str) -> list[str]:
    """What the README's first screen lacks: the install, the two commands, and the table of
    which node to use (its every row, linking every node's page)."""
    lines = readme.splitlines()
    heading_at = {}
    for number, line in prose_lines(readme):
        match = HEADING.match(line)
        if match:
            heading_at.setdefault(github_slug(match.group(2)), number)
    found = [f"no heading '{slug}' in the first {FIRST_SCREEN} lines"
             for slug in ("install", "try-it-two-commands", "which-node-when")
             if heading_at.get(slug, FIRST_SCREEN + 1) > FIRST_SCREEN]
    screen = "\n".join(lines[:FIRST_SCREEN])
    found += [f"'{text}' is not in the first {FIRST_SCREEN} lines"
              for text in ("pip install -r", "make demo", "make test") if text not in screen]
    start = heading_at.get("which-node-when")
    if start is not None:
        rows, number = [], start
        while number < len(lines) and not lines[number].startswith("|"):
            number += 1
        while number < len(lines) and lines[number].startswith("|"):
            rows.append((number + 1, lines[number]))
            number += 1
        if len(rows) < 4:
            found.append("the which-node table has fewer than two rows")
        elif rows[-1][0] > FIRST_SCREEN:
            found.append(f"the which-node table ends at line {rows[-1][0]}, past the first screen")
        table = "\n".join(row for _, row in rows)
        found += [f"the which-node table does not link {page}" for page in NODE_PAGES
                  if posixpath.basename(page) not in table]
    return found


def repository_files() -> set[str]:
    """What GitHub shows once this checkout is pushed: tracked files and new ones git does not
    ignore; outside a git checkout, every file on disk."""
    try:
        listed = [subprocess.run(["git", "ls-files", *extra], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split("\n")
                  for extra in ((), ("--others", "--exclude-standard"))]
    except (OSError, subprocess.CalledProcessError):
        return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()}
    return {name for names in listed for name in names if name and (ROOT / name).is_file()}


def pages() -> list[str]:
    return ["README.md", "ARCHITECTURE.md",
            *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_every_relative_link_and_anchor_resolves():
    files = repository_files()
    checked = pages()
    assert "docs/README.md" in checked and len(checked) > 10, checked
    found = [p for page in checked for p in link_problems(page, read(page), files, read)]
    assert found == [], "\n".join(found)


def test_every_docs_page_is_reachable_from_the_index():
    index = {posixpath.normpath(posixpath.join("docs", t.partition("#")[0]))
             for _, t in links(read("docs/README.md")) if not EXTERNAL.match(t)}
    assert [p for p in pages() if p.startswith("docs/") and p != "docs/README.md"
            and p not in index] == []


def test_the_readme_front_page_holds_install_commands_and_which_node_first():
    found = first_screen_problems(read("README.md"))
    assert found == [], "\n".join(found)


def test_a_broken_link_or_anchor_is_found():
    files = repository_files()
    page = read("docs/README.md") + "\n".join([
        "",
        "[gone](no-such-page.md)",                            # a file that does not exist
        "[bad anchor](api.md#no-such-heading)",                 # a heading that does not exist
        "[own](#no-such-heading-here)",                         # the same page's anchor
        "[up](../../outside.md)",                               # above the repository
        "[artifact](../tests/artifacts/node.zip)",               # ignored: not on GitHub
        "[ok](api.md#routes) [ok too](../README.md#install)",   # fine
        "```",
        "[in a code sample](not-a-link.md)",
        "```",
        "`[in code](not-a-link-either.md)`",
    ])
    found = link_problems("docs/README.md", page, files, read)
    assert [p.split(": ", 1)[1] for p in found] == [
        "no-such-page.md: no such file in the repository",
        "api.md#no-such-heading: no heading makes the anchor #no-such-heading",
        "#no-such-heading-here: no heading makes the anchor #no-such-heading-here",
        "../../outside.md: leaves the repository",
        "../tests/artifacts/node.zip: no such file in the repository",
    ], found


def test_anchors_follow_githubs_rules():
    assert github_slug("Apply Layerwise Offload (`MODEL → MODEL`)") == "apply-layerwise-offload-model--model"
    assert github_slug("`bench/disk_stream.py`: disk streaming against RAM") == \
        "benchdisk_streampy-disk-streaming-against-ram"
    assert github_slug("Tiered UNET / Checkpoint / CLIP / VAE Loader") == "tiered-unet--checkpoint--clip--vae-loader"
    assert github_slug("How `auto` makes core keep the node's choice, at every load") == \
        "how-auto-makes-core-keep-the-nodes-choice-at-every-load"
    assert anchors("# A\n## A\n```\n# B\n```\n<a id=\"c\"></a>\n") == {"a", "a-1", "c"}


def test_a_front_page_that_hides_its_first_screen_is_found():
    readme = read("README.md")
    pushed_down = "\n" * FIRST_SCREEN + readme
    found = first_screen_problems(pushed_down)
    assert "no heading 'install' in the first 50 lines" in found, found
    assert "'make demo' is not in the first 50 lines" in found, found
    assert any(p.startswith("the which-node table ends at line") for p in found), found
    without_swap = readme.replace("(docs/model-level-swap.md)", "(docs/api.md)")
    assert first_screen_problems(without_swap) == [
        "the which-node table does not link docs/model-level-swap.md"]


def test_the_install_commands_are_the_real_ones():
    """The install a user copies works as written: the repository URL and the registry id of
    pyproject.toml (what `comfy node publish` and ComfyUI-Manager use), the same everywhere."""
    project = tomllib.loads(read("pyproject.toml"))["project"]
    url, name = project["urls"]["Repository"], project["name"]
    for page in ("README.md", "docs/install.md"):
        text = read(page)
        assert f"git clone {url} custom_nodes/{name}" in text, page
        assert f"pip install -r custom_nodes/{name}/requirements.txt" in text, page
        assert f"comfy node install {name}" in text and "ComfyUI-Manager" in text, page
        assert "<this repository>" not in text, page
    for page in pages():
        for found in re.findall(r"https?://[^\s)>`'\"]*" + re.escape(name) + r"[^\s)>`'\"]*", read(page)):
            assert found == url or found.startswith(url + "/"), f"{page}: {found} is not {url}"


# Words of how the pack is being built, which mean nothing to its users: what they read (the
# README, docs/, the panel and the node help in web/, locales/, the example workflows' notes)
# speaks of the pack ("not yet measured on a GPU"), never of sessions, issues or who builds it.
# A file or code name that holds such a word (`bench/gpu_session.sh`, `LayerwiseSession`) is fine.
BUILD_PROCESS_WORDS = [re.compile(p, re.I) for p in (
    r"(?<![\w./-])sessions?(?![\w-]|\.\w)",
    r"\bissues?\s+#?\d+",
    r"\b(?:this|last|next|that) stop\b|\bstop's\b",
    r"\bha(?:s|ve|d) had (?:a|any|the|one)\b",
    r"\blent\b",
    r"\bthe lead\b|\bworktrees?\b|\bbriefing\b|\bgive_back\b|\bengineers?\b|\bhelpers? working\b",
    r"\bdevice (?:tool|call)s?\b",
)]
USER_TEXT_SUFFIXES = (".md", ".js", ".css", ".json")


def user_text_files() -> list[str]:
    """Every file of what users read: the README, docs/, web/, locales/, example_workflows/."""
    return ["README.md", *sorted(
        name for name in repository_files()
        if name.startswith(("docs/", "web/", "locales/", "example_workflows/"))
        and name.endswith(USER_TEXT_SUFFIXES))]


def build_process_wording(page: str, text: str) -> list[str]:
    return [f"{page}:{number}: '{match.group(0)}' in: {line.strip()[:120]}"
            for number, line in enumerate(text.splitlines(), 1)
            for pattern in BUILD_PROCESS_WORDS for match in [pattern.search(line)] if match]


def test_what_users_read_speaks_of_the_pack_not_of_how_it_is_built():
    checked = user_text_files()
    assert "docs/benchmarks.md" in checked and any(n.startswith("locales/") for n in checked)
    assert any(n.startswith("web/") and n.endswith(".js") for n in checked), checked
    found = [p for name in checked for p in build_process_wording(name, read(name))]
    assert found == [], "\n".join(found)


def test_build_process_wording_is_found():
    page = "\n".join([
        "No session has had a GPU yet.",                    # 1: session, has had a
        "Measured before issue 24; this stop's run.",       # 2: issue 24, this stop
        "Some sessions are lent a GPU machine.",           # 3: sessions (lent: same line)
        "Ask the lead.",                                   # 4
        "The device tool sends the worktree.",             # 5
        "See `bench/gpu_session.sh` and `session.py`: LayerwiseSession.session_for, "
        "nodes/layerwise/session.py.",                      # file and code names: fine
        "Not yet measured on a GPU; the copies stop when a run ends.",   # fine
    ])
    found = build_process_wording("page.md", page)
    assert [f.split(" in: ", 1)[0] for f in found] == [
        "page.md:1: 'session'", "page.md:1: 'has had a'", "page.md:2: 'issue 24'",
        "page.md:2: 'this stop'", "page.md:3: 'sessions'", "page.md:3: 'lent'",
        "page.md:4: 'the lead'", "page.md:5: 'worktree'", "page.md:5: 'device tool'"], found


# What the pack's readers read is about the pack: never about the machines, limits or tools of
# those building it.
BUILD_WORDS = re.compile(r"\blent\b|device tool|device[- ]minutes|give_back|\bCI's\b|90-minute|"
                         r"CI time|this session|device time left", re.I)


def reader_pages() -> list[Path]:
    """Every page a user or contributor reads: the README, the manual, the architecture, the
    nodes' help pages, the locales, and the heads of the scripts in bench/ and tools/."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "web" / "docs").rglob("*.md")), *sorted((ROOT / "locales").rglob("*.json")),
             *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "bench").glob("*.sh")),
             *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "tools").glob("*"))]
    return [p for p in pages if p.is_file() and p.suffix not in (".pyc",)]


def build_words(text: str) -> list[str]:
    return sorted({m.group(0) for m in BUILD_WORDS.finditer(text)})


def test_what_readers_read_speaks_of_the_pack_only():
    found = {str(p.relative_to(ROOT)): words for p in reader_pages()
             if (words := build_words(p.read_text(encoding="utf-8", errors="replace")))}
    assert not found, found


def test_words_of_the_build_are_found():
    assert build_words("Some sessions are lent a GPU for 15 device-minutes; call give_back.") == [
        "device-minutes", "give_back", "lent"]
    assert build_words("the session of a layerwise model; a CI-free page") == []


NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
                "ten": 10}


def test_counts_in_the_docs_are_what_they_count():
    """A number a page gives of the pack's own things is theirs: the benchmarks docs/benchmarks.md
    opens with are its sections, one per script in bench/; the lanes docs/tests.md names are the
    rows of its table and the Makefile's test targets."""
    page = read("docs/benchmarks.md")
    sections = re.findall(r"^## `bench/([\w]+\.py)`", page, re.M)
    assert all((ROOT / "bench" / name).is_file() for name in sections), sections
    said = re.search(r"^(\w+) benchmarks\.", page, re.M)
    assert said and NUMBER_WORDS[said.group(1).lower()] == len(sections), (said and said.group(0), sections)
    tests_page = read("docs/tests.md")
    lanes = re.findall(r"^\| `make (test-[\w.-]+)` \|", tests_page, re.M)
    said = re.search(r"runs\s+(\w+) lanes", tests_page)
    assert said and NUMBER_WORDS[said.group(1)] == len(lanes), (said and said.group(0), lanes)
    makefile = read("Makefile")
    assert all(f"$(MAKE) --no-print-directory {lane}" in makefile for lane in lanes), lanes
    assert f"runs {said.group(1)} lanes" in makefile.replace("\n# ", " ")


LOG_PREFIX = "[tiered offload] "
LOG_LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def log_messages(source: str) -> list[tuple[int, str | None]]:
    """(line, the literal text a log call's message starts with, or None where the message is not
    a literal) of every call on a module's ``log`` or ``logger``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger")):
            continue
        at = 0 if node.func.attr in LOG_LEVELS else 1 if node.func.attr == "log" else None
        if at is None or len(node.args) <= at:
            continue
        message = node.args[at]
        if isinstance(message, ast.JoinedStr):
            message = message.values[0] if message.values else None
        found.append((node.lineno, message.value if isinstance(message, ast.Constant)
                      and isinstance(message.value, str) else None))
    return found


def test_every_log_line_of_the_pack_starts_with_its_one_prefix():
    """ComfyUI's log shows messages without their logger's name: each line the pack logs starts
    with one prefix, so a user finds all of the pack's lines, and only them, by it."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for folder in ("offload_core", "nodes") for path in sorted((ROOT / folder).rglob("*.py"))
             for line, text in log_messages(path.read_text())
             if text is None or not text.startswith(LOG_PREFIX)]
    assert not wrong, "\n".join(wrong)


def test_a_log_line_without_the_prefix_is_found():
    source = ('log.info("[tiered offload] fine %s", x)\nlog.warning("disk stream: %s", x)\n'
              'logger.log(level, f"[tiered offload] {x}")\nlog.info(message)\n')
    assert log_messages(source) == [(1, "[tiered offload] fine %s"), (2, "disk stream: %s"),
                                    (3, "[tiered offload] "), (4, None)]

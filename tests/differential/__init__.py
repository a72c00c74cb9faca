"""Randomized differential test: every prompt on a server with the pack (P) against its stripped
twin on a server without it (Q), same ComfyUI, same machine, same thread count.

Modules: `catalogue` (the fixture files a campaign samples from), `probe` (which of them this
ComfyUI loads), `workflow` (an API-format graph builder), `generator` (seeded prompt sequences),
`twin` (removes the pack's nodes), `refusals` (the pack's documented refusals), `verdict`
(compares one prompt's two outcomes), `progress` (websocket watch to interrupt at a chosen
moment), `servers` (the P/Q pair), `runner` (runs steps), `campaign` (seeds, replay files,
summary), `report` (text for people), `minimize` and `shrink` (replay a failing sequence and
make it as small as it stays failing); `python -m tests.differential` is the command line.
"""
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
for _path in (TESTS, TESTS / "fixtures"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

ARTIFACTS = TESTS / "artifacts" / "differential"

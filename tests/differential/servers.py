"""The two servers of a differential run: P with the pack, Q without it, one models folder.

Both run the ComfyUI tree and Python that `TIERED_OFFLOAD_COMFY_ROOT` /
`TIERED_OFFLOAD_COMFY_PYTHON` select, with the same thread count, so equal inputs give equal
bits. They start and stop together; a restart gives both fresh processes (and fresh state).

Dynamo keeps up to 64 graphs per function on both, not torch's 8 (tests/comfy_test_nodes): a
campaign compiles many models, and past the limit a function runs eagerly. P's graphs are not all
Q's (P compiles nothing for a prompt it refuses; before docs/torch-compile.md#recompiles was
fixed, P's streamed weights and wrapper table also failed guards Q's did not), so at 8 the two
reached the limit at different graphs, and a later compiled prompt without the pack ran compiled
on one and eagerly on the other (seed 57 on 0.33: a mismatch that went away, replayed in full,
with the higher limit).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from comfy_server import ComfyServer

RECOMPILE_LIMIT = 64


class ServerPair:
    def __init__(self, workdir: Path, models_root: Path, *, threads: int = 2) -> None:
        self.workdir = workdir
        self.models_root = models_root
        self.threads = threads
        self.p: ComfyServer | None = None
        self.q: ComfyServer | None = None
        self._log_marks: dict[str, int] = {}

    def _server(self, name: str, with_pack: bool) -> ComfyServer:
        base = self.workdir / name
        base.mkdir(parents=True, exist_ok=True)
        models = base / "models"
        if not models.exists():
            models.symlink_to(self.models_root.resolve(), target_is_directory=True)
        return ComfyServer(base, threads=self.threads, with_pack=with_pack,
                           env={"TIERED_TEST_DYNAMO_RECOMPILE_LIMIT": str(RECOMPILE_LIMIT)})

    def start(self) -> "ServerPair":
        self.p, self.q = self._server("p", True), self._server("q", False)
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(s.start) for s in (self.p, self.q)]:
                future.result()
        return self

    def stop(self) -> None:
        for server in (self.p, self.q):
            if server is not None:
                server.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def new_log_lines(self, server: ComfyServer) -> list[str]:
        """Log lines the server wrote since the last call for it."""
        text = server.log_text()
        start = self._log_marks.get(str(server.log_path), 0)
        self._log_marks[str(server.log_path)] = len(text)
        return text[start:].splitlines()

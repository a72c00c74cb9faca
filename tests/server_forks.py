"""Test servers forked from a warm parent, so that a test's server start skips the imports every
start repeats.

A ComfyUI start spends most of its seconds importing the same third-party packages (torch,
transformers, scipy, SQLAlchemy, aiohttp, ...) before any of ComfyUI's own code runs. A test
session starts dozens of servers, so the harness keeps one *fork parent* per ComfyUI tree: a
process of the tree's Python that has imported those packages once and forks a child for each
server. The child then does exactly what ``python main.py <args>`` does from there on (the same
argv, environment, working folder, log file and session), ComfyUI's own modules and the custom
nodes included, so nothing of ComfyUI or the pack is shared between servers.

The parent imports only and starts no thread (a fork copies just the forking thread;
tests/test_server_forks.py checks it has one). Only imports that read nothing a server varies
are made ahead: the parent runs with the lane's environment and thread count, and a server whose
environment differs in a variable those packages read at import (``OMP_*``, ``TORCH*``,
``HF_*``, ...) is started the ordinary way.

Run as a script, this module is the fork parent (standard library only, so that any tree's
Python runs it); imported, it is the harness's side: :class:`ForkParent` and the process handle
:class:`ForkedServer`, which answers like ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``returncode``). The parent reports each child's exit status on the connection that asked for
it, since only a process's parent can collect it.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
from pathlib import Path

# What a ComfyUI start imports from site-packages and takes longest to import (measured with
# `python -X importtime main.py` on 0.3.75 and 0.33.0); a name a tree's Python lacks is skipped.
# "module:name" also looks the name up (a lazily loaded class).
WARM_IMPORTS = (
    "torch", "torch._dynamo", "torchvision", "torchaudio", "numpy", "safetensors.torch",
    "transformers", "tokenizers", "sentencepiece", "huggingface_hub", "scipy.stats",
    "scipy.signal", "scipy.ndimage", "sympy", "sqlalchemy", "sqlalchemy.orm", "alembic",
    "aiohttp", "aiohttp.web", "pydantic", "pydantic_settings", "kornia", "spandrel", "av",
    "yaml", "PIL.Image", "psutil", "tqdm", "torchsde", "einops", "requests", "comfy_kitchen",
    "comfyui_frontend_package", "comfyui_workflow_templates",
    # transformers loads its classes on first use; ComfyUI's text encoders name these at import.
    "transformers:CLIPTokenizer", "transformers:T5TokenizerFast", "transformers:LlamaTokenizerFast",
    "transformers:BertTokenizer",
)
# Variables that main.py sets before its first import, set in the parent the same way.
MAIN_PY_ENV = {"HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
# Environment variables read when those packages are imported: a server that sets one of them
# differently from the parent cannot be forked from it.
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH_",
                        "CUDA_", "HIP_", "ROCM_", "HF_", "TRANSFORMERS_", "HUGGINGFACE_",
                        "TOKENIZERS_", "LD_", "PYTHON", "NUMPY_", "SCIPY_", "MALLOC_", "TMP")


# -- the fork parent (runs under the ComfyUI tree's Python) ---------------------------------------
def _serve(name: str, tree: str) -> None:
    """Import the warm set, then fork a server for each request until stdin closes."""
    sys.path[0] = tree  # as `python main.py` from the tree: its folder first
    os.environ.update(MAIN_PY_ENV)
    import importlib
    for warm in WARM_IMPORTS:
        module, _, attribute = warm.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attribute:
                getattr(loaded, attribute)
        except Exception:  # noqa: BLE001 - a package this tree lacks, or one that cannot load here
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():  # the harness ended: so does the parent
                    return
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                request = json.loads(_read_line(conn)[0])
                pid = os.fork()
                if pid == 0:
                    _become_child(request, [listener, conn, *children.values()], sel)
                children[pid] = conn
                conn.sendall(f'{{"pid": {pid}}}\n'.encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f'{{"returncode": {os.waitstatus_to_exitcode(status)}}}\n'.encode())
                except OSError:
                    pass
                conn.close()


def _read_line(conn: socket.socket) -> tuple[str, bytes]:
    """One line from ``conn``, and what came after it."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("the connection closed mid-message")
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line.decode(), rest


def _become_child(request: dict, inherited: list[socket.socket],
                   sel: selectors.BaseSelector) -> None:
    """In the forked child: take the request's session, files, folder, environment and argv,
    then run its script (main.py, or a fixture script) as `python <script>` would; never return."""
    code = 1
    try:
        os.setsid()
        sel.close()
        for sock in inherited:
            sock.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python <script>`
        # main.py warns when torch was imported before it: here it was, on purpose and with the
        # same environment. The warning alone is dropped from the server's log.
        import logging
        logging.getLogger().addFilter(
            lambda record: "Torch already imported" not in record.getMessage())
        import runpy
        try:
            runpy.run_path(request["argv"][0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed to the server's log, as Python would
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# -- the harness's side ------------------------------------------------------------------------------
class ForkedServer:
    """A forked server as `subprocess.Popen` would answer for it. Its exit status comes from the
    fork parent over ``conn``; ``pid`` is the server's (its own session: ``killpg`` reaches it)."""

    def __init__(self, conn: socket.socket, pid: int, received: bytes = b"") -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._buffer = received

    def _take(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self._conn.recv(4096)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        except (BlockingIOError, TimeoutError):
            return
        except (EOFError, OSError):
            # The parent ended without a word on this server (it never does while the harness
            # runs): the server is taken as ended, with the status of a killed process.
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = json.loads(self._buffer.partition(b"\n")[0])["returncode"]
        self._conn.close()

    def poll(self) -> int | None:
        self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
        return self.returncode


class ForkParent:
    """One warm parent for one ComfyUI tree, Python and environment (started on first use,
    stopped with the harness's process: its stdin is the harness's pipe)."""

    def __init__(self, python: str, tree: Path, env: dict[str, str]) -> None:
        self.python = python
        self.tree = tree
        self.env = dict(env)
        # A Linux abstract socket (a name, no file): gone with the parent, nothing to clean up.
        self.name = f"tiered-offload-tests-{os.getpid()}-{id(self)}"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a server with this environment may be forked from this parent."""
        changed = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)}
        return not any(k.startswith(IMPORT_TIME_PREFIXES) for k in changed)

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._proc = subprocess.Popen(
            [self.python, str(Path(__file__).resolve()), self.name, str(self.tree)],
            cwd=self.tree, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True)
        line = self._proc.stdout.readline()
        if line.strip() != b"ready":
            self._proc.kill()
            raise RuntimeError(f"the fork parent for {self.tree} did not start ({line!r})")

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedServer:
        self._ensure()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + self.name)
        conn.sendall((json.dumps({"argv": argv, "env": env, "cwd": str(cwd),
                                  "log": str(log)}) + "\n").encode())
        line, rest = _read_line(conn)
        return ForkedServer(conn, json.loads(line)["pid"], rest)

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


class ForkParents:
    """The session's fork parents, one per tree, Python and import-time environment (a server
    whose environment no parent accepts gets a new one, up to ``limit``; past it, None: that
    server starts the ordinary way)."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self._parents: list[ForkParent] = []

    def parent_for(self, python: str, tree: Path, env: dict[str, str], *,
                   start: bool = True) -> ForkParent | None:
        """The parent to fork from; ``start=False``: only one already there (a process run once
        a session gains nothing from a parent of its own)."""
        for parent in self._parents:
            if parent.python == python and parent.tree == tree and parent.accepts(env):
                return parent
        if not start or len(self._parents) >= self.limit:
            return None
        parent = ForkParent(python, tree, env)
        self._parents.append(parent)
        return parent

    def close(self) -> None:
        for parent in self._parents:
            parent.close()
        self._parents.clear()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])

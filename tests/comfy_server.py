"""A real ComfyUI server for tests: started on a free loopback port, stopped by its PID.

The server runs from the ComfyUI tree the Makefile builds (.comfyui/) with an isolated base
directory, so tests never touch a user's models or settings. Our pack and the test-only nodes
are linked into that base's custom_nodes/.

Models are classic unless a server asks for Dynamic VRAM: ComfyUI 0.15 and later load every
model with Dynamic VRAM on NVIDIA, where the suite's tests (written against classic models, as
every CPU run has them) would test something else, so on CUDA a tree that has the switch gets
`--disable-dynamic-vram`. tests/test_dynamic_vram_gpu.py and bench/comfy_wan.py --dynamic ask
for Dynamic VRAM (`dynamic_vram=True`) and get core's default.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from server_forks import ForkedServer, ForkParents

REPO = Path(__file__).resolve().parent.parent
# The third-party packs the tests load beside the pack, checked (make third-party, tools/sources.py).
THIRD_PARTY = REPO / ".sources" / "third_party"
# Another ComfyUI tree (and the Python that runs it) can be tested against, e.g. a newer release.
COMFY_ROOT = Path(os.environ.get("TIERED_OFFLOAD_COMFY_ROOT", REPO / ".comfyui"))
COMFY_PYTHON = os.environ.get("TIERED_OFFLOAD_COMFY_PYTHON", sys.executable)
# Whether that is the tree the Makefile builds beside .venv/ (the lane that runs every test).
DEFAULT_TREE = COMFY_ROOT.resolve() == (REPO / ".comfyui").resolve()
PACK_LINK_NAME = "comfyui-tiered-offload"
TEST_NODES_LINK_NAME = "tiered_offload_test_nodes"
OUR_NODES = ("ApplyLayerwiseOffload",)
TEST_NODES = ("TieredTestLatentStats",)


# Set by the test session (tests/conftest.py): servers are then forked from warm parents
# (tests/server_forks.py). None (benchmarks, the demo, a script): every server is its own start.
fork_parents: ForkParents | None = None


def _fork_parent(env: dict[str, str], *, start: bool = True):
    """The session's warm parent for a process of the tree under test with this environment, or
    None: no session parents, or a machine with CUDA (main.py chooses the allocator before torch
    is imported, so torch must not be imported ahead). ``start=False``: only a running one."""
    import torch
    if fork_parents is None or torch.cuda.is_available():
        return None
    return fork_parents.parent_for(COMFY_PYTHON, COMFY_ROOT, env, start=start)


def comfy_version(root: Path = COMFY_ROOT) -> str:
    """The version a ComfyUI tree declares (comfyui_version.py), without importing it."""
    text = (root / "comfyui_version.py").read_text()
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if match is None:
        raise RuntimeError(f"no __version__ in {root / 'comfyui_version.py'}")
    return match.group(1)


def run_tree_script(script: Path, out: Path, *, threads: int, timeout: int,
                    env: dict[str, str] | None = None) -> dict:
    """Run a fixture script that imports the ComfyUI tree under test, with the tree's own Python
    (a newer ComfyUI imports packages the 0.3.75 venv lacks), and return the JSON it writes.
    ``env``: variables set for the script on top of this process's (PYTHONPATH, say)."""
    if not (COMFY_ROOT / "comfy" / "model_detection.py").is_file():
        import pytest
        pytest.skip(f"no ComfyUI tree at {COMFY_ROOT}")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    argv = [str(script), str(out), "--comfyui", str(COMFY_ROOT)]
    # Forked from the session's warm parent where one with this environment is running already.
    parent = _fork_parent(env, start=False)
    if parent is None:
        proc = subprocess.run([COMFY_PYTHON, *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return json.loads(out.read_text())
    log = out.with_name(out.name + ".log")
    child = parent.spawn(argv, env, REPO, log)
    try:
        returncode = child.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(60)
        raise
    assert returncode == 0, f"{script.name} failed:\n{log.read_text(errors='replace')[-8000:]}"
    return json.loads(out.read_text())


def has_dynamic_vram_switch(root: Path) -> bool:
    """Whether a ComfyUI tree can turn Dynamic VRAM off (0.15 and later: `--disable-dynamic-vram`)."""
    try:
        return "--disable-dynamic-vram" in (root / "comfy" / "cli_args.py").read_text()
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base(base: Path, extra_nodes: dict[str, Path] | None = None, *,
                 with_pack: bool = True, test_nodes: bool = True) -> Path:
    """Lay out a ComfyUI base directory with our pack (unless `with_pack` is false: the
    differential test's reference server), the test nodes (unless a user's server is wanted, as
    for the demo) and any extra node folders (name -> folder; the benchmarks link their own)
    linked into custom_nodes/."""
    custom = base / "custom_nodes"
    custom.mkdir(parents=True, exist_ok=True)
    links = dict(extra_nodes or {})
    if with_pack:
        links[PACK_LINK_NAME] = REPO
    if test_nodes:
        links[TEST_NODES_LINK_NAME] = REPO / "tests" / "comfy_test_nodes"
    for name, target in links.items():
        link = custom / name
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    if not settings.exists():
        settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    return base


def _entry() -> list[str]:
    """How the server starts: ``main.py``, or, in a session run with ``-p posix_removed``, main.py
    behind the same plugin, so that the server's pack lacks the same calls as the tests'."""
    if "posix_removed" not in sys.modules:
        return ["main.py"]
    tests = str(Path(__file__).resolve().parent)
    return ["-c", f"import runpy, sys; sys.path.insert(0, {tests!r}); import posix_removed; "
                  "sys.argv[0] = 'main.py'; runpy.run_path('main.py', run_name='__main__')"]


def _stop_with_parent() -> None:
    """In the child before it runs ComfyUI: SIGTERM when the parent dies (Linux prctl
    PR_SET_PDEATHSIG; elsewhere nothing: the caller's own handlers stop the server)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class PromptFailed(AssertionError):
    def __init__(self, entry: dict):
        self.entry = entry
        super().__init__(json.dumps(entry.get("status", {}), indent=1)[:6000])


class ComfyServer:
    def __init__(self, base: Path, *, extra_args: tuple[str, ...] = (), threads: int = 2,
                 port: int | None = None, extra_nodes: dict[str, Path] | None = None,
                 env: dict[str, str] | None = None, with_pack: bool = True,
                 test_nodes: bool = True, dynamic_vram: bool = False, dies_with_caller: bool = False) -> None:
        # with_pack=False: the same ComfyUI without the pack, as the reference of the
        # differential test (the test-only nodes are still there). dynamic_vram=True: core's
        # default loading on this tree and device (see the module docstring).
        self.with_pack = with_pack
        self.dynamic_vram = dynamic_vram
        # The server is stopped (SIGTERM) when the process that started it ends, however it ends
        # (Linux: the parent-death signal), so that no ComfyUI outlives a demo killed outright.
        self.dies_with_caller = dies_with_caller
        self.base = prepare_base(base, extra_nodes, with_pack=with_pack, test_nodes=test_nodes)
        self.env = env or {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = extra_args
        self.threads = threads
        self.log_path = base / f"comfy-{self.port}.log"
        self.proc: subprocess.Popen | ForkedServer | None = None
        self._log = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> "ComfyServer":
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1", **self.env)
        cmd = [COMFY_PYTHON, *_entry(), "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-auto-launch", "--disable-api-nodes",
               "--base-directory", str(self.base),
               "--database-url", f"sqlite:///{self.base / 'user' / 'comfyui.db'}",
               "--log-stdout", *self.cpu_args(), *self.classic_args(), *self.extra_args]
        parent = self._fork_parent(env)
        if parent is not None:
            self.proc = parent.spawn(cmd[1:], env, COMFY_ROOT, self.log_path)
        else:
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                cmd, cwd=COMFY_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
                preexec_fn=_stop_with_parent if self.dies_with_caller else None)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                stats = self.get("/system_stats", timeout=2)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.05)  # a refused connection costs nothing: ask often
                continue
            argv = stats.get("system", {}).get("argv", [])
            if str(self.base) not in argv:
                # Another process's server answered on this port: ours cannot have bound it.
                self.stop()
                raise RuntimeError(f"port {self.port} is another server's (argv {argv})")
            break
        else:
            self.stop()
            raise RuntimeError(f"ComfyUI not ready after {timeout:.0f} s:\n{self.log_tail()}")
        try:
            self.check_pack_loaded()
        except BaseException:  # a server whose pack failed to load is stopped, not left running
            self.stop()
            raise
        return self

    def _fork_parent(self, env: dict[str, str]):
        """The warm parent to fork this server from (`_fork_parent`), or None to start it as its
        own process: also main.py behind a plugin, and a server that must die with its caller."""
        if _entry() != ["main.py"] or self.dies_with_caller:
            return None
        return _fork_parent(env)

    @staticmethod
    def cpu_args() -> tuple[str, ...]:
        import torch
        return () if torch.cuda.is_available() else ("--cpu",)

    def classic_args(self) -> tuple[str, ...]:
        """`--disable-dynamic-vram` where core would otherwise load with Dynamic VRAM (CUDA and a
        tree that has the switch), unless this server asks for Dynamic VRAM."""
        import torch
        wanted = self.dynamic_vram or not torch.cuda.is_available()
        return () if wanted or not has_dynamic_vram_switch(COMFY_ROOT) else ("--disable-dynamic-vram",)

    def check_pack_loaded(self) -> None:
        ours = [link.name for link in (self.base / "custom_nodes").iterdir()]
        for line in self.log_text().splitlines():
            if "IMPORT FAILED" in line and any(name in line for name in ours):
                raise RuntimeError(f"our pack failed to import: {line}\n{self.log_tail()}")
        info = self.get("/object_info")
        missing = [n for n in (OUR_NODES if self.with_pack else TEST_NODES) if n not in info]
        if missing:
            raise RuntimeError(f"nodes missing from /object_info: {missing}\n{self.log_tail()}")
        if not self.with_pack and any(n in info for n in OUR_NODES):
            raise RuntimeError("a server started without the pack serves its nodes")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self._log is not None:
            self._log.close()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- logs -----------------------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- HTTP -------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                timeout: float = 30) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                payload = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            payload, status = e.read(), e.code
        try:
            return status, json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return status, payload.decode(errors="replace")

    def get(self, path: str, timeout: float = 30) -> Any:
        status, body = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise AssertionError(f"GET {path} -> {status}: {body}")
        return body

    def loaded_tier(self) -> str:
        """The tier the API gives a managed model loaded on the compute device: "cpu" where the
        server has no GPU (no VRAM tier there), else "vram"."""
        return "cpu" if self.get("/offload/tiers")["devices"]["vram"]["total"] == 0 else "vram"

    def post(self, path: str, body: Any = None) -> Any:
        status, payload = self.request("POST", path, body)
        if status != 200:
            raise AssertionError(f"POST {path} -> {status}: {payload}")
        return payload

    # -- prompts ----------------------------------------------------------------------------------
    def queue(self, workflow: dict, *, client_id: bool | str = True) -> str:
        """Queue a workflow; `client_id=False` queues it the way API scripts often do, without
        one (ComfyUI then sends that prompt no execution messages, only broadcast progress); a
        string queues it with that client id."""
        if client_id is True:
            client_id = str(uuid.uuid4())
        body = {"prompt": workflow, **({"client_id": client_id} if client_id else {})}
        status, resp = self.request("POST", "/prompt", body)
        if status != 200:
            raise AssertionError(f"POST /prompt -> {status}: {json.dumps(resp)[:4000]}")
        return resp["prompt_id"]

    def refused(self, workflow: dict, node: str) -> str:
        """Queue a workflow that ComfyUI must refuse at queue time (400); return the details of
        the errors it names for `node`, joined (one per input the node's check names)."""
        status, body = self.request("POST", "/prompt", {"prompt": workflow})
        assert status == 400, (status, json.dumps(body)[:4000])
        return " ".join(e.get("details", "") for e in body["node_errors"][node]["errors"])

    def queue_running(self, workflow: dict, *, client_id: bool = True, timeout: float = 120) -> str:
        """Queue a workflow and return its prompt id once it has reported progress (a sampler
        step, the engine's packing): from then on an /interrupt stops it.

        ComfyUI clears its interrupt flag when a prompt starts executing. The pack sees a prompt
        start (its models in use, the queue running) a moment before that, so an interrupt sent
        on those signs alone can be wiped out and the prompt runs to its end. A prompt queued
        without a client id still broadcasts its progress, which the listener hears.
        """
        from ws_listener import WsListener

        with WsListener(self.url) as ws:
            prompt_id = self.queue(workflow, client_id=ws.client_id if client_id else False)
            ws.wait_for(lambda m: m.get("type") == "progress"
                        and (m.get("data") or {}).get("prompt_id") == prompt_id,
                        timeout, f"progress of prompt {prompt_id}")
        return prompt_id

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        # Most test prompts take well under a second: ask soon, then less often (the server
        # answers each request between its sampling steps).
        delay = 0.01
        while time.time() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            entry = hist.get(prompt_id) if hist else None
            if entry and entry.get("status", {}).get("completed") is not None \
                    and entry["status"].get("status_str") in ("success", "error"):
                return entry
            if not self.alive():
                raise RuntimeError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        raise TimeoutError(f"prompt {prompt_id} not finished after {timeout} s")

    def run(self, workflow: dict, timeout: float = 300) -> dict:
        """Queue a workflow and return its /history outputs; raise PromptFailed on error."""
        entry = self.wait(self.queue(workflow), timeout)
        if entry["status"]["status_str"] != "success":
            raise PromptFailed(entry)
        return entry["outputs"]

    def run_expect_error(self, workflow: dict, timeout: float = 300) -> dict:
        """Queue a workflow that must fail at execution; return its error message payload."""
        entry = self.wait(self.queue(workflow), timeout)
        assert entry["status"]["status_str"] == "error", entry["status"]
        for kind, data in entry["status"]["messages"]:
            if kind == "execution_error":
                return data
        raise AssertionError(f"no execution_error in {entry['status']}")

    def interrupt(self) -> None:
        self.post("/interrupt", {})

    def free(self) -> None:
        """Drop ComfyUI's output cache and unload every model; return once that is done.

        POST /free only sets flags, which the prompt worker reads after each prompt and when it
        wakes with an empty queue. A prompt queued right after the request can be taken before the
        worker has read them: it then runs on the old state and the free lands after it, dropping
        the model it just loaded (and the pack's state for that model). The worker reads its
        flags once between any two prompts, so two barrier prompts of core nodes follow the
        request: by the end of the second, the free has run.
        """
        self.post("/free", {"unload_models": True, "free_memory": True})
        # The cheapest prompt of core nodes on every version; a cached answer still passes
        # through the worker's loop, which is all a barrier needs.
        barrier = {"n": {"class_type": "PrimitiveInt", "inputs": {"value": 0}},
                   "show": {"class_type": "PreviewAny", "inputs": {"source": ["n", 0]}}}
        for prompt_id in [self.queue(barrier) for _ in range(2)]:
            entry = self.wait(prompt_id)
            if entry["status"]["status_str"] != "success":
                raise PromptFailed(entry)

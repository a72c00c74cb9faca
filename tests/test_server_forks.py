"""A server forked from the session's warm parent (tests/server_forks.py) is the server that
`python main.py` starts: the same argv, nodes and results, its exit status reported as Popen
reports a child's, and nothing in its log that an ordinary start does not write.

Every other server test runs on forked servers, so this is what lets their results stand for a
user's server. The server tests of the POSIX-removed lane start each server the ordinary way.
"""
from __future__ import annotations

import os
import signal

import pytest

import comfy_server
from comfy_server import COMFY_PYTHON, COMFY_ROOT, ComfyServer
from server_forks import ForkedServer, ForkParents
from workflows import latent_sha, sample_workflow


@pytest.fixture
def parents():
    if comfy_server.fork_parents is None:
        pytest.skip("servers start as their own processes in this session (TIERED_OFFLOAD_TEST_FORKS=0)")
    if not ComfyServer.cpu_args():
        pytest.skip("servers are not forked on a machine with CUDA")
    return comfy_server.fork_parents


def _models(server: ComfyServer, comfy_base) -> ComfyServer:
    (server.base / "models").symlink_to(comfy_base / "models", target_is_directory=True)
    return server


def test_a_forked_server_answers_and_computes_as_an_ordinary_start(tmp_path, comfy_base, parents, monkeypatch):
    forked = _models(ComfyServer(tmp_path / "forked"), comfy_base).start()
    try:
        assert isinstance(forked.proc, ForkedServer)
        forked_stats = forked.get("/system_stats")
        forked_nodes = set(forked.get("/object_info"))
        forked_sha = latent_sha(forked.run(sample_workflow("wan21", steps=2)))
    finally:
        forked.stop()
    monkeypatch.setattr(comfy_server, "fork_parents", None)
    plain = _models(ComfyServer(tmp_path / "plain"), comfy_base).start()
    try:
        assert not isinstance(plain.proc, ForkedServer)
        plain_stats = plain.get("/system_stats")
        plain_nodes = set(plain.get("/object_info"))
        plain_sha = latent_sha(plain.run(sample_workflow("wan21", steps=2)))
    finally:
        plain.stop()
    assert forked_sha == plain_sha
    assert forked_nodes == plain_nodes
    for key in ("comfyui_version", "python_version", "pytorch_version", "embedded_python"):
        assert forked_stats["system"].get(key) == plain_stats["system"].get(key), key
    # The same argv, but for the folders and port each was given.
    def shape(stats, server):
        return [a.replace(str(server.base), "BASE").replace(str(server.port), "PORT")
                for a in stats["system"]["argv"]]
    assert shape(forked_stats, forked) == shape(plain_stats, plain)
    assert "Torch already imported" not in forked.log_text()
    assert "Traceback" not in forked.log_text()
    # A fork copies only the thread that forks: the parent must have no other (a package that
    # starts one at import would leave its children without it).
    parent = parents.parent_for(COMFY_PYTHON, COMFY_ROOT, dict(os.environ, OMP_NUM_THREADS="2",
                                                               PYTHONUNBUFFERED="1"), start=False)
    assert parent is not None and parent.pid is not None
    if os.path.isdir(f"/proc/{parent.pid}/task"):
        assert os.listdir(f"/proc/{parent.pid}/task") == [str(parent.pid)]


def test_a_forked_servers_exit_status_is_reported_like_a_childs(tmp_path, parents):
    server = ComfyServer(tmp_path / "killed").start()
    assert isinstance(server.proc, ForkedServer) and server.alive()
    os.killpg(server.proc.pid, signal.SIGKILL)  # its own session, as an ordinary start's
    assert server.proc.wait(timeout=60) == -signal.SIGKILL
    assert not server.alive()
    server.stop()
    # An argument main.py refuses: argparse's exit status and message, in the server's log.
    refused = ComfyServer(tmp_path / "refused", extra_args=("--no-such-option",))
    with pytest.raises(RuntimeError, match="exited with 2"):
        refused.start()
    assert "unrecognized arguments: --no-such-option" in refused.log_text()


def test_an_environment_read_at_import_gets_its_own_parent(tmp_path):
    parents = ForkParents(limit=1)
    lane = dict(os.environ, OMP_NUM_THREADS="2")
    first = parents.parent_for(COMFY_PYTHON, COMFY_ROOT, lane)
    assert parents.parent_for(COMFY_PYTHON, COMFY_ROOT, {**lane, "TIERED_TEST_X": "1"}) is first
    # torch reads the thread count when it is imported: not from this parent, and past the
    # limit not from a new one either (such a server starts the ordinary way).
    assert parents.parent_for(COMFY_PYTHON, COMFY_ROOT, {**lane, "OMP_NUM_THREADS": "1"}) is None
    assert parents.parent_for(COMFY_PYTHON, tmp_path, lane) is None  # another tree
    parents.close()

"""Unit tests import the engine from the pack root and the toy models from this folder."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(autouse=True)
def _single_cpu_thread():
    """Toy tensors are tiny: OpenMP fan-out only adds spin contention on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stream_model(request, monkeypatch):
    """The stream model (tests/unit/stream_model.py) installed as the CPU device's ordering for
    this test (see ``installed``); the test fails if the engine broke an ordering rule, including
    frees checked once the test has dropped its objects. Copy delays are seeded by the test's id."""
    import zlib

    from stream_model import StreamModel, installed

    model = StreamModel(seed=zlib.crc32(request.node.nodeid.encode()))
    with installed(model, monkeypatch):
        yield model
    assert not model.violations, "\n".join(model.violations)


@pytest.fixture(autouse=True)
def _device_model(request):
    """A test parametrized with ``device`` "model" runs its CPU device under the stream model."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "model":
        request.getfixturevalue("stream_model")

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
    """The stream model (tests/unit/stream_model.py) installed as the CPU device's ordering and
    watching this test's thread; the test fails if the engine broke an ordering rule, including
    frees checked once the test has dropped its objects. Copy delays are seeded by the test's id.
    The disk store's reads into host buffers are host writes the model cannot see by itself:
    they are told to it."""
    import gc
    import zlib

    from stream_model import StreamModel

    from offload_core.disk.store import DiskStore
    from offload_core.ordering import install_model

    model = StreamModel(seed=zlib.crc32(request.node.nodeid.encode()))
    read = DiskStore.read

    def told_read(store, i, dst, start=0, length=None):
        model.host_write(dst, "disk read in DiskStore.read")
        return read(store, i, dst, start, length)

    monkeypatch.setattr(DiskStore, "read", told_read)
    install_model(model)
    try:
        with model.watch():
            yield model
    finally:
        install_model(None)
        gc.collect()
        model.close()
    assert not model.violations, "\n".join(model.violations)


@pytest.fixture(autouse=True)
def _device_model(request):
    """A test parametrized with ``device`` "model" runs its CPU device under the stream model."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "model":
        request.getfixturevalue("stream_model")

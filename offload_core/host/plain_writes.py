"""The autograd state the engine writes its buffers in.

The engine's buffers outlive the prompt that fills them, so they are written outside inference
mode (a tensor made in inference mode can never be written outside it), and no write may record
autograd history: a weight patch may hold tensors that require grad (a model merge's patches are
the other model's parameters), and ops with an ``out=`` argument refuse them. Leaving inference
mode with ``torch.inference_mode(False)`` turns grad mode *on*, so ``no_grad`` must come inside it,
never before it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def plain_writes() -> Iterator[None]:
    """Outside inference mode, with grad mode off, whatever mode the caller was in."""
    with torch.inference_mode(False), torch.no_grad():
        yield

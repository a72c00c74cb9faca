"""Forward hooks that tell an engine when each block starts and ends.

Why hooks: the model's own block loop stays untouched (ComfyUI model code, dit
replace patches, block caches), so nothing has to be called per block.  The
pre-hook is prepended so other pre-hooks already see the weights; the post-hook
uses ``always_call`` so a block that raises still hands its slot back.

Hooks that move weights run eagerly, outside any torch.compile graph
(``torch.compiler.disable``): dynamo breaks the graph at the hooked module's
call, runs the hook as plain Python, and compiles the module's forward as a
graph of its own, whose parameters are graph inputs read when it runs, so the
same graph serves the weights of whichever slot the hook bound.  A hook that
must do nothing inside a graph may stay traceable (``eager=False``) and say so
itself, so that it leaves the graph whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class BlockHooks:
    """Pre/post forward hooks on ``(index, module)`` pairs, removable as one unit; no post-hook
    without ``on_exit``. ``eager``: the hooks never run inside a torch.compile graph."""

    def __init__(
        self,
        blocks: Sequence[tuple[int, nn.Module]],
        on_enter: Callable[[int], None],
        on_exit: Callable[[int], None] | None = None,
        *,
        eager: bool = True,
    ) -> None:
        self._handles: list[RemovableHandle] = []
        for index, module in blocks:
            self._handles.append(
                module.register_forward_pre_hook(_pre(index, on_enter, eager), with_kwargs=True, prepend=True)
            )
            if on_exit is not None:
                self._handles.append(
                    module.register_forward_hook(_post(index, on_exit, eager), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _outside_graphs(hook: Callable, eager: bool) -> Callable:
    return torch.compiler.disable(hook, recursive=True) if eager else hook


def _pre(index: int, on_enter: Callable[[int], None], eager: bool) -> Callable:
    def offload_enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        on_enter(index)

    return _outside_graphs(offload_enter, eager)


def _post(index: int, on_exit: Callable[[int], None], eager: bool) -> Callable:
    def offload_exit(module: nn.Module, args: tuple, output: object) -> None:
        on_exit(index)

    return _outside_graphs(offload_exit, eager)

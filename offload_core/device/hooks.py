"""Forward hooks that tell an engine when each block starts and ends.

Why hooks: the model's own block loop stays untouched (ComfyUI model code, dit
replace patches, block caches), so nothing has to be called per block.  The
pre-hook is prepended so other pre-hooks already see the weights; the post-hook
uses ``always_call`` so a block that raises still hands its slot back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle


class BlockHooks:
    """Pre/post forward hooks on ``(index, module)`` pairs, removable as one unit; no post-hook without ``on_exit``."""

    def __init__(
        self,
        blocks: Sequence[tuple[int, nn.Module]],
        on_enter: Callable[[int], None],
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self._handles: list[RemovableHandle] = []
        for index, module in blocks:
            self._handles.append(
                module.register_forward_pre_hook(_pre(index, on_enter), with_kwargs=True, prepend=True)
            )
            if on_exit is not None:
                self._handles.append(module.register_forward_hook(_post(index, on_exit), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _pre(index: int, on_enter: Callable[[int], None]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        on_enter(index)

    return hook


def _post(index: int, on_exit: Callable[[int], None]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: object) -> None:
        on_exit(index)

    return hook

"""Which layers a compression touches: the model's block list, the target linears, the layer groups.

:func:`find_blocks` finds the repeated transformer blocks (``encoder.layer`` of BERT, ``model.layers``
of Llama); :func:`resolve_targets` turns a :mod:`rankwise.core.select` selector (default: every
``nn.Linear`` inside the blocks) into ``(name, nn.Linear)`` pairs; :func:`layer_groups` groups the
layers of a block by the tensor they read (``{q, k, v} -> o -> {gate, up} -> down``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.layers import LowRankLinear
from rankwise.core.select import Selector, select
from rankwise.core.stats import CalibrationError

Tensor = torch.Tensor

__all__ = ["find_blocks", "block_of", "resolve_targets", "layer_groups", "first_tensor_arg", "out_tensor",
           "StopForward"]


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's list of repeated transformer blocks as ``(path, module_list)``.

    With ``path``, that submodule (an ``nn.ModuleList`` / ``nn.Sequential`` of blocks; anything else
    raises :class:`~rankwise.core.errors.SelectionError`). Without, the ``nn.ModuleList`` whose
    children all have one class and which holds the most parameters (``encoder.layer`` of BERT,
    ``model.layers`` of Llama); None when the model has none.
    """
    if path is not None:
        if not isinstance(path, str) or not path:
            raise TypeError(f"blocks must be the dotted path of a ModuleList, got {path!r}")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise SelectionError(f"blocks={path!r}: the model has no submodule of that name") from None
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
            raise SelectionError(f"blocks={path!r} is a {type(mod).__name__}, not a non-empty ModuleList of blocks")
        return path, mod  # type: ignore[return-value]
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(c) for c in mod}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size == 0:
            continue
        key = (size, -name.count("."))
        if best is None or key > best[:2]:
            best = (size, -name.count("."), name, mod)
    return None if best is None else (best[2], best[3])


def block_of(name: str, path: str, n_blocks: int) -> int | None:
    prefix = path + "." if path else ""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() and int(head) < n_blocks else None


def _inside_lowrank(model: nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    while True:
        if isinstance(model.get_submodule(parent) if parent else model, LowRankLinear):
            return True
        if not parent:
            return False
        parent = parent.rpartition(".")[0]


def resolve_targets(model: nn.Module, target: Selector = None, *, blocks: str | None = None
                    ) -> list[tuple[str, nn.Linear]]:
    """The ``(name, nn.Linear)`` pairs to compress, in model order.

    ``target=None``: every ``nn.Linear`` inside the transformer blocks (:func:`find_blocks`). Otherwise a
    :mod:`rankwise.core.select` selector; a selected module that is a linear map of another type
    (GPT-2's ``Conv1D``, ``nn.Embedding``, anything with a 2-D ``weight`` that is not an ``nn.Linear``)
    raises ``TypeError``; containers and norms a pattern happens to match are skipped. The factors of
    an already compressed layer (``*.down`` / ``*.up`` of a ``LowRankLinear``) are never targets.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if target is None:
        found = find_blocks(model, blocks)
        if found is None:
            raise SelectionError("the model has no list of repeated blocks (nn.ModuleList) to take the default "
                                 "targets from; pass target=... (e.g. nn.Linear or a name pattern)")
        path, _ = found
        hits = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(path + ".")]
    else:
        if isinstance(target, type) or (isinstance(target, tuple) and target and all(isinstance(t, type) for t in target)):
            types = target if isinstance(target, tuple) else (target,)
            bad = [t.__name__ for t in types if not issubclass(t, nn.Linear)]
            if bad:
                raise TypeError(f"target types {bad} are not nn.Linear; rankwise compresses nn.Linear layers only "
                                "(for GPT-2's Conv1D, convert it to nn.Linear first: weight.T)")
        hits = select(model, target)
        wrong = [(n, type(m).__name__) for n, m in hits if not isinstance(m, nn.Linear)
                 and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.ndim >= 2]
        if wrong:
            raise TypeError(f"target {target!r} selects modules that are not nn.Linear: {wrong[:5]}; rankwise "
                            "compresses nn.Linear layers only (GPT-2's Conv1D stores the transposed weight: "
                            "convert it to nn.Linear first)")
        hits = [(n, m) for n, m in hits if isinstance(m, nn.Linear)]
    hits = [(n, m) for n, m in hits if not _inside_lowrank(model, n)]
    if not hits:
        raise SelectionError(f"target {target!r} selects no nn.Linear layer to compress")
    return hits  # type: ignore[return-value]


class StopForward(Exception):
    """Raised by a hook to end a forward pass early (nothing after that point is needed)."""


def first_tensor_arg(args: tuple, kwargs: dict) -> tuple[Tensor | None, int | str | None]:
    if args and isinstance(args[0], torch.Tensor):
        return args[0], 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], "hidden_states"
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return a, i
    return None, None


def out_tensor(out: Any) -> Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    hs = getattr(out, "last_hidden_state", None)
    if isinstance(hs, torch.Tensor):
        return hs
    raise TypeError(f"a block returned {type(out).__name__}; expected a tensor or a tuple starting with one")


def layer_groups(block: nn.Module, names: Sequence[str], run: Callable[[], Any]) -> list[list[str]]:
    """Group the layers ``names`` (relative to ``block``) by the tensor they read, in call order.

    ``run()`` runs ``block`` once (e.g. on one calibration batch). Layers called with the same input
    tensor (same storage, shape and strides) form one group: BERT ``[[query, key, value],
    [attention.output.dense], [intermediate.dense], [output.dense]]``, Llama ``[[q, k, v], [o],
    [gate, up], [down]]``. Raises :class:`~rankwise.core.stats.CalibrationError` naming layers that
    ``run`` never called.
    """
    seen: list[tuple[str, tuple]] = []
    handles = []
    # the inputs stay referenced until the grouping is done: a freed input's address can be handed to the
    # next layer's (different) input tensor, which would then look like the same tensor
    alive: list[torch.Tensor] = []

    def hook(name: str) -> Callable:
        def pre(mod: nn.Module, args: tuple) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None and all(n != name for n, _ in seen):
                alive.append(x)
                seen.append((name, (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape),
                                    tuple(x.stride()))))
        return pre

    try:
        for n in names:
            handles.append(block.get_submodule(n).register_forward_pre_hook(hook(n)))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    alive.clear()
    missing = [n for n in names if all(n != s for s, _ in seen)]
    if missing:
        raise CalibrationError(f"the calibration batch never reached layer(s) {missing} (the hook never fired); "
                               "they cannot be calibrated")
    groups: list[list[str]] = []
    last_key = None
    for n, key in seen:
        if groups and key == last_key:
            groups[-1].append(n)
        else:
            groups.append([n])
        last_key = key
    return groups

"""Replace, wrap and restore modules of a model; count and freeze parameters.

Every change goes through :func:`replace_module`, which records the original module so that
:func:`restore` can undo it. :func:`transaction` makes a multi-module change all-or-nothing: if any
step raises, every module replaced inside the block is put back before the error propagates, so a
failed in-place operation leaves the model as it was.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn


def get_submodule(model: nn.Module, name: str) -> nn.Module:
    """The submodule at qualified ``name`` ('' is the model itself)."""
    return model.get_submodule(name) if name else model


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    if not name:
        raise ValueError("cannot replace the root module itself")
    parent_name, _, child = name.rpartition(".")
    return get_submodule(model, parent_name), child


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``name`` and return the module that was there.

    Only a registered submodule can be replaced (not a parameter, buffer or plain attribute; a
    missing name raises ``AttributeError``). Inside :func:`transaction` on the same ``model`` object
    the change is journaled so that it can be undone.
    """
    if not isinstance(new, nn.Module):
        raise TypeError(f"replacement for {name!r} must be an nn.Module, got {type(new).__name__}")
    parent, child = _parent(model, name)
    old = getattr(parent, child)
    if not isinstance(old, nn.Module) or child not in parent._modules:
        raise TypeError(f"{name!r} is a {type(old).__name__}, not a submodule; only submodules can be replaced")
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and child.isdigit():
        parent[int(child)] = new
    else:
        setattr(parent, child, new)
    log = _journal.get(id(model))
    if log is not None:
        log.append((name, old))
    return old


def wrap_module(model: nn.Module, name: str, wrapper: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Replace the module at ``name`` by ``wrapper(module)``; returns the wrapper."""
    old = get_submodule(model, name)
    new = wrapper(old)
    replace_module(model, name, new)
    return new


_journal: dict[int, list[tuple[str, nn.Module]]] = {}


@contextlib.contextmanager
def transaction(model: nn.Module) -> Iterator[list[tuple[str, nn.Module]]]:
    """All-or-nothing surgery: on an exception, undo every replacement done inside the block.

    The ``requires_grad`` flags of the parameters are also snapshotted and put back. Parameter
    *values* are not: weights modified in place by the caller are the caller's to protect.
    Nested transactions on the same model are supported (an outer rollback also undoes the
    inner block's committed changes).
    """
    outer = _journal.get(id(model))
    log: list[tuple[str, nn.Module]] = []
    _journal[id(model)] = log
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        yield log
    except BaseException:
        for name, old in reversed(log):
            parent, child = _parent(model, name)
            if isinstance(parent, (nn.ModuleList, nn.Sequential)) and child.isdigit():
                parent[int(child)] = old
            else:
                setattr(parent, child, old)
        for n, p in model.named_parameters():
            if n in flags:
                p.requires_grad_(flags[n])
        raise
    finally:
        if outer is None:
            _journal.pop(id(model), None)
        else:
            outer.extend(log)
            _journal[id(model)] = outer


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def parameter_report(model: nn.Module) -> dict[str, float]:
    """Total, trainable and the trainable fraction (what PEFT's print_trainable_parameters says)."""
    total = count_parameters(model)
    train = count_parameters(model, trainable_only=True)
    return {"total": total, "trainable": train, "fraction": train / total if total else 0.0}


def freeze(model: nn.Module, except_: Callable[[str, torch.nn.Parameter], bool] | None = None) -> int:
    """Set ``requires_grad=False`` on every parameter (except those ``except_`` keeps); returns the count frozen."""
    n = 0
    for name, p in model.named_parameters():
        if except_ is not None and except_(name, p):
            continue
        if p.requires_grad:
            p.requires_grad_(False)
            n += 1
    return n


def unfreeze(model: nn.Module, only: Callable[[str, torch.nn.Parameter], bool] | None = None) -> int:
    """Set ``requires_grad=True`` on parameters (all, or those ``only`` selects); returns the count."""
    n = 0
    for name, p in model.named_parameters():
        if only is not None and not only(name, p):
            continue
        if not p.requires_grad:
            p.requires_grad_(True)
            n += 1
    return n

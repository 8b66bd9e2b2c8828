"""The federated family's method registry: name -> strategy logic, client, default task and config.

Each method module registers its methods when it is imported (:func:`register_method`); the runner,
the deployed apps and ``rankwise federate`` look them up here (:func:`get`, :func:`names`). Flower's
simulation engine and each SuperNode run the apps in fresh processes, so a lookup first imports the
family's method modules listed in :data:`PROVIDERS` (a lazy import table; nothing is imported when
this module is): every process that resolves a method name knows every built-in method, and this
module imports no method module at import time (no import cycle through the runner).

A method of your own: call :func:`register_method` in your module and add the module with
:func:`add_provider` (in every process that resolves the name, e.g. in the module that your task
factory string names, which each client process imports).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FederatedMethod", "PROVIDERS", "add_provider", "get", "names", "register_method"]

#: modules that register the built-in methods, imported on the first lookup (order = listing order)
PROVIDERS: list[str] = ["rankwise.federated.fslora", "rankwise.federated.baselines", "rankwise.federated.ub_smoe"]


@dataclass(frozen=True)
class FederatedMethod:
    """One registered method.

    Attributes:
        name: the method id (``rankwise federate --method``).
        logic: the :class:`~rankwise.federated.strategy.LoRAStrategyLogic` subclass (or a zero-argument
            callable returning it, resolved on first use).
        strategy_name: the name of the Flower strategy class built from it (``FSLoRAStrategy``, ...).
        client_factory: ``f(task, task_kwargs, faults) -> client_fn`` for clients that differ from the
            LoRA client; None: :func:`rankwise.federated.client.make_client_fn`.
        default_task: the ``rankwise federate --task`` name used when none is given.
        config: the config class the method reads (:class:`~rankwise.federated.config.FederatedConfig`
            or a subclass); a run config carrying that subclass's fields is rebuilt as it.
    """

    name: str
    logic: Any
    strategy_name: str
    client_factory: Callable[..., Any] | None = None
    default_task: str = "minilm"
    config: type | None = None

    def logic_class(self) -> type:
        return self.logic if isinstance(self.logic, type) else self.logic()

    def strategy_class(self) -> type:
        """The Flower strategy class (``logic`` mixed into Flower's FedAvg; imports flwr)."""
        from rankwise.federated.strategy import flower_class

        return flower_class(self.logic_class(), self.strategy_name)


_METHODS: dict[str, FederatedMethod] = {}
_LOADED: set[str] = set()
_LOCK = threading.RLock()


def register_method(name: str, logic: Any, strategy_name: str, *, client_factory: Callable[..., Any] | None = None,
                    default_task: str = "minilm", config: type | None = None) -> FederatedMethod:
    """Register (or replace) method ``name``; see :class:`FederatedMethod` for the arguments."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"method name must be a non-empty string, got {name!r}")
    entry = FederatedMethod(name, logic, strategy_name, client_factory, default_task, config)
    with _LOCK:
        _METHODS[name] = entry
    return entry


def add_provider(module: str) -> None:
    """Import ``module`` on the next lookup (it registers methods with :func:`register_method`)."""
    with _LOCK:
        if module not in PROVIDERS:
            PROVIDERS.append(module)


def _load() -> None:
    with _LOCK:
        for module in list(PROVIDERS):
            if module not in _LOADED:
                _LOADED.add(module)  # before the import: a provider may look methods up while it loads
                importlib.import_module(module)


def names() -> tuple[str, ...]:
    """The registered method names, in the order of :data:`PROVIDERS` whatever was imported first (built
    in: fslora, fedavg, hetlora, flexlora, ub-smoe, smoe-naive, smoe-llb, a3smoe, florist)."""
    _load()
    order = {name: i for i, name in enumerate(_METHODS)}

    def provider(name: str) -> int:
        module = getattr(_METHODS[name].logic, "__module__", "")
        return PROVIDERS.index(module) if module in PROVIDERS else len(PROVIDERS)

    return tuple(sorted(_METHODS, key=lambda n: (provider(n), order[n])))


def get(name: str) -> FederatedMethod:
    """The method registered as ``name``; ValueError listing the registered names otherwise."""
    _load()
    if name not in _METHODS:
        raise ValueError(f"method must be one of {names()}, got {name!r}")
    return _METHODS[name]

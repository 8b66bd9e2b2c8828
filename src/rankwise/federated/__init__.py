"""Federated fine-tuning on Flower: FSLoRA and its baselines (FedAvg-LoRA, HetLoRA, FlexLoRA, FLoRIST),
UB-SMoE and its SMoE baselines.

The family's pieces: :mod:`.config` (:class:`FederatedConfig`, shared by every method), :mod:`.registry`
(method name -> strategy logic, client, default task, config), :mod:`.strategy` (the shared server
logic), :mod:`.defences` (norm bounds, example caps, robust aggregation, the health check),
:mod:`.client` (the shared client and its training loop), :mod:`.tasks`, :mod:`.runner` and
:mod:`.app` (simulation and deployment).

Importing this package does not import flwr; the Flower classes (``FSLoRAStrategy``, ...) are built
on first access. See docs/federated.md for simulation and deployment. ``FSLoRAConfig`` is the
deprecated former name of :class:`FederatedConfig`.
"""

from __future__ import annotations

from typing import Any

from rankwise.federated.config import FederatedConfig

__all__ = [
    "FederatedConfig",
    "FSLoRAStrategy",
    "FedAvgLoRAStrategy",
    "FlexLoRAStrategy",
    "HetLoRAStrategy",
    "LoRAClient",
    "RunSettings",
    "SyntheticMoETask",
    "SyntheticTask",
    "build_strategy",
    "initial_state",
    "make_client_app",
    "make_client_fn",
    "make_fslora_client_app",
    "make_server_app",
    "methods",
    "run_federated",
]

_LAZY = {
    "FSLoRAStrategy": "rankwise.federated.fslora",
    "FedAvgLoRAStrategy": "rankwise.federated.baselines",
    "HetLoRAStrategy": "rankwise.federated.baselines",
    "FlexLoRAStrategy": "rankwise.federated.baselines",
    "LoRAClient": "rankwise.federated.client",
    "make_client_fn": "rankwise.federated.client",
    "RunSettings": "rankwise.federated.runner",
    "build_strategy": "rankwise.federated.runner",
    "initial_state": "rankwise.federated.runner",
    "make_client_app": "rankwise.federated.runner",
    "make_server_app": "rankwise.federated.runner",
    "methods": "rankwise.federated.runner",
    "run_federated": "rankwise.federated.runner",
    "SyntheticTask": "rankwise.federated.tasks",
    "SyntheticMoETask": "rankwise.federated.tasks",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "FSLoRAConfig":  # deprecated alias (warns)
        return importlib.import_module("rankwise.federated.config").FSLoRAConfig
    if name == "make_fslora_client_app":
        return importlib.import_module("rankwise.federated.runner").make_client_app
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rankwise.federated' has no attribute {name!r}")

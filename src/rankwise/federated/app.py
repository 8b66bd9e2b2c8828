"""The Flower apps for deployment: ``rankwise.federated.app:server_app`` and ``rankwise.federated.app:client_app``.

Both read a :class:`~rankwise.federated.runner.RunSettings` from the Flower run config (key
``rankwise-settings``, a JSON document), so one app directory describes a whole run and the same
apps run in the simulation engine and on a SuperLink with SuperNodes. :func:`write_app_dir` writes
such a directory (a ``pyproject.toml`` only: the components live in the installed rankwise package,
so SuperExecs must run in an environment where rankwise is installed, with
``--disable-runtime-dependency-installation``). See docs/federated.md.

The two app objects are built on first access (module ``__getattr__``; Flower's static check finds
them in ``__all__``), so importing this module does not import flwr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rankwise.core import io
from rankwise.federated.runner import RunSettings, make_client_app, make_server_app

__all__ = ["client_app", "pyproject_text", "server_app", "write_app_dir"]

_APPS: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """``server_app`` / ``client_app``, built on first access (so importing this module does not import flwr)."""
    if name in ("server_app", "client_app"):
        if name not in _APPS:
            _APPS[name] = make_server_app() if name == "server_app" else make_client_app()
        return _APPS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pyproject_text(settings: RunSettings, name: str = "rankwise-fl", publisher: str = "rankwise") -> str:
    """The ``pyproject.toml`` of a Flower app that runs ``settings`` with this module's apps."""
    if not isinstance(settings, RunSettings):
        raise TypeError(f"settings must be a RunSettings, got {type(settings).__name__}")
    cfg = settings.to_run_config()
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f"name = {json.dumps(name)}",
        'version = "1.0.0"',
        f'description = {json.dumps("rankwise federated LoRA run: " + settings.method)}',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        f"publisher = {json.dumps(publisher)}",
        "",
        "[tool.flwr.app.components]",
        'serverapp = "rankwise.federated.app:server_app"',
        'clientapp = "rankwise.federated.app:client_app"',
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in cfg.items()]
    return "\n".join(lines) + "\n"


def write_app_dir(directory: str | Path, settings: RunSettings, *, overwrite: bool = False, **kwargs: Any) -> Path:
    """Write a Flower app directory (``pyproject.toml`` + a one-line module) for ``settings``, atomically."""
    directory = Path(directory)
    with io.atomic_dir(directory, overwrite=overwrite) as tmp:
        io.atomic_write_text(tmp / "pyproject.toml", pyproject_text(settings, **kwargs))
        (tmp / "rankwise_fl_app.py").write_text('"""The apps live in rankwise.federated.app."""\n'
                                                "from rankwise.federated.app import client_app, server_app  # noqa: F401\n")
    return directory

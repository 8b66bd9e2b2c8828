"""The ``rankwise`` verbs, one module per verb (``list``, ``reproduce``, ``report``, ``zoo``, ``compress``,
``finetune``, ``merge``, ``federate``).

Each verb module defines ``register(app: typer.Typer) -> None`` that adds its command(s) to the
``rankwise`` app; :mod:`rankwise.cli` calls every one at import time and does nothing else. A verb is
thin: it parses options, calls one library function and prints. What verbs share (the console,
progress, the one-line error format, mode/seed parsing) is :mod:`rankwise.verbs.common`; no verb
imports :mod:`rankwise.cli`. Library modules are imported inside the command function so that
``rankwise --help`` stays fast.
"""

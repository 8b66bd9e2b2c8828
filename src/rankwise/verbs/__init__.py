"""More ``rankwise`` verbs, one module per verb (``finetune``, ``merge``, ``federate``, ...).

Each module here defines ``register(app: typer.Typer) -> None`` that adds its command(s) to the
``rankwise`` app; :mod:`rankwise.cli` calls every one at import time. A verb module is CLI code: it may
import :mod:`rankwise.cli` (for ``_console``, ``_progress`` and the shared option parsing) and any
library module, and it stays thin — it parses options and calls one library function. Keeping each
verb in its own file lets a method family own its command without editing ``cli.py``.
"""

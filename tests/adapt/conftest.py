"""Load the shared adapter contract (``contract.py``) and parametrise tests over it.

``contract.py`` is registered in ``sys.modules`` as ``rankwise_tests_adapt_contract`` (a unique name,
independent of pytest's import mode and of other test folders' helper modules), and every test that
takes the fixtures ``adapter_case`` and ``model_kind`` runs once per (adapter, tiny model) pair.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "rankwise_tests_adapt_contract"


def _load_contract():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name("contract.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_NAME, None)
        raise
    return module


contract = _load_contract()


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "adapter_case" in names and "model_kind" in names:
        pairs = [(c, k) for c in contract.ADAPTERS for k in c.kinds]
        metafunc.parametrize(("adapter_case", "model_kind"), pairs, ids=[f"{c.name}-{k}" for c, k in pairs])
    elif "adapter_case" in names:
        metafunc.parametrize("adapter_case", contract.ADAPTERS, ids=[c.name for c in contract.ADAPTERS])

"""Triton's Python-backend utilities (triton_python_backend_utils) for the serving modules.

Only Triton's stub provides that module (model.py imports it before anything here runs): `pb_utils`
looks each name up in it when it is used, so the serving modules import without Triton, and a stand-in
placed in sys.modules (tests) is the one used.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Stub:
    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("triton_python_backend_utils"), name)


pb_utils: Any = _Stub()

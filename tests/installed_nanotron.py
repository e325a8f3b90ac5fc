"""Which Nanotron is installed, found without importing it (importing ``nanotron`` or its models pulls in torch,
which the planner's tests never need and the root conftest must not pay for).

"upstream" when upstream main is installed (it ships Qwen2: ``nanotron/models/qwen.py``), "0.2" otherwise.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def installed_nanotron() -> str:
    """ "upstream" or "0.2", from the files of the installed ``nanotron`` package (nothing is imported).

    Raises:
        ModuleNotFoundError: no ``nanotron`` is installed (install the project with ``pip install -e .[cpu,test]``).
    """
    # find_spec of a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec("nanotron")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "no 'nanotron' package is installed; the tests need nanotron==0.2 or upstream "
            "main (pip install -e '.[cpu,test]')"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    return "upstream" if (package / "models" / "qwen.py").is_file() else "0.2"


#: The Nanotron under test.
NANOTRON = installed_nanotron()

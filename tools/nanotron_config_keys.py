"""Print the keys of the installed Nanotron's ``Config`` as JSON, for ``nanotron_ext/data/nanotron_config_keys.json``.

Run once per Nanotron the project supports (``nanotron==0.2``; upstream main with ``tests/upstream_stubs`` on
``PYTHONPATH``) and store the output under that version's name. A nested dataclass becomes a mapping of its
keys (unions merged: ``model_config`` is every model family's keys), anything else ``null``.
``tests/test_bad_input.py`` checks the stored table against whichever Nanotron is installed.
"""

from __future__ import annotations

import json

if __name__ == "__main__":
    from nanotron_ext.config_keys import installed_nanotron_keys

    keys = installed_nanotron_keys()
    if keys is None:
        raise SystemExit("no Nanotron is importable here; activate the environment of the version to record")
    print(json.dumps(keys, indent=1, sort_keys=True))

"""Print the keys of the installed Nanotron's ``Config`` as JSON, for ``nanotron_ext/data/nanotron_config_keys.json``.

Run once per Nanotron the project supports (``nanotron==0.2``; upstream main with ``tests/upstream_stubs`` on
``PYTHONPATH``) and store the output under that version's name. A nested dataclass becomes a mapping of its
keys (unions merged: ``model_config`` is every model family's keys), anything else ``null``.
``tests/test_bad_input.py`` checks the stored table against whichever Nanotron is installed.
"""

from __future__ import annotations

import dataclasses
import json
import typing


def config_keys(cls: type) -> dict[str, object]:
    """Keys of a config dataclass, nested dataclasses (also inside unions and lists) as mappings."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        subs = [b for a in (typing.get_args(hints[f.name]) or (hints[f.name],))
                for b in (typing.get_args(a) or (a,)) if dataclasses.is_dataclass(b)]
        if subs:
            merged: dict[str, object] = {}
            for sub in subs:
                for key, value in config_keys(sub).items():
                    merged[key] = value if merged.get(key) is None else merged[key]
            out[f.name] = merged
        else:
            out[f.name] = None
    return out


if __name__ == "__main__":
    from nanotron.config import Config

    print(json.dumps(config_keys(Config), indent=1, sort_keys=True))

"""Prefect's current settings with a few values changed, for a block of code.

Prefect's `temporary_settings` builds its Settings again from every source (environment,
profile, .env, pyproject's TOML) and validates all of it: 26 ms per call on this 2-core
VM, paid by every command that points Prefect at the resident API (local_api.py).
`overridden` copies the current settings objects with the values replaced (pydantic's
model_copy: 0.1 ms) and enters them as Prefect's SettingsContext, as
`temporary_settings` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def overridden(updates: Mapping[str, Any]) -> Iterator[Any]:
    """The block runs with `updates` ({"api.url": url}, dotted paths
    of Prefect's Settings) over the current settings. Values are not validated: each must
    be of its field's type already (a SecretStr for `api.auth_string`)."""
    from prefect.context import SettingsContext, get_settings_context

    context = get_settings_context()
    settings = context.settings
    sections: dict[str, dict[str, Any]] = {}
    for key, value in updates.items():
        section, _, field = key.partition(".")
        part = getattr(settings, section, None)
        if part is None or not field or field not in type(part).model_fields:
            raise KeyError(f"no Prefect setting {key!r}")
        sections.setdefault(section, {})[field] = value
    copied = settings.model_copy(update={
        section: getattr(settings, section).model_copy(update=fields)
        for section, fields in sections.items()
    })  # fmt: skip
    with SettingsContext(profile=context.profile, settings=copied):
        yield copied

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
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# A self-signed certificate whose private key was thrown away when it was made (openssl,
# 2026-12-07): no server can present a certificate it signed, so a TLS context that
# trusts only it verifies nothing. See plain_http_tls.
PLAIN_HTTP_CA = Path(__file__).with_name("plain_http_ca.pem")


def plain_http_tls(url: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment for Prefect's clients of the API at `url`: PREFECT_API_SSL_CERT_FILE
    set to PLAIN_HTTP_CA where `url` is plain HTTP and the environment chose neither a CA
    file nor to skip verification; {} otherwise.

    Each PrefectClient builds a TLS context from certifi's 117 certificates when it is
    made (prefect/client/orchestration: PrefectClient.__init__), also for an http:// API,
    which never uses it: 40-50 ms of CPU each on the 2-core VM, and a cached research
    run in a warm process's child made 7 (0.35 s of CPU in a ~2 s run), every flow run
    more. With one certificate the context takes 0.7 ms. It is never used on plain
    HTTP; were it used (the URL changed to https:// without this setting following),
    verification would fail rather than trust anyone."""
    if not url.lower().startswith("http://"):
        return {}
    if environ.get("PREFECT_API_SSL_CERT_FILE") or environ.get(
        "PREFECT_API_TLS_INSECURE_SKIP_VERIFY", ""
    ).strip().lower() in ("1", "true", "yes", "on"):
        return {}
    return {"PREFECT_API_SSL_CERT_FILE": str(PLAIN_HTTP_CA)}


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

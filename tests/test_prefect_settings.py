"""tasks/runtime/prefect_settings.py: the CA file Prefect's clients load for a plain-HTTP
API (one certificate, not certifi's 117), where it is set and where it is left alone."""

from __future__ import annotations

import os
import ssl

import pytest

from quantloop.tasks.runtime.local_api import ApiHandle
from quantloop.tasks.runtime.prefect_settings import PLAIN_HTTP_CA, plain_http_tls


def test_a_plain_http_api_gets_the_one_certificate_and_https_keeps_its_own():
    assert plain_http_tls("http://127.0.0.1:4200/api", {}) == {
        "PREFECT_API_SSL_CERT_FILE": str(PLAIN_HTTP_CA)
    }
    assert plain_http_tls("HTTP://desk:4200/api", {})  # a scheme in capitals is still plain
    assert plain_http_tls("https://api.prefect.cloud/api/accounts/a/workspaces/w", {}) == {}
    # the user's own choices stand
    assert plain_http_tls("http://127.0.0.1:4200/api", {"PREFECT_API_SSL_CERT_FILE": "/ca"}) == {}
    skip = {"PREFECT_API_TLS_INSECURE_SKIP_VERIFY": "true"}
    assert plain_http_tls("http://127.0.0.1:4200/api", skip) == {}


def test_the_file_is_one_ca_certificate_a_tls_context_loads():
    ctx = ssl.create_default_context(cafile=str(PLAIN_HTTP_CA))
    [ca] = ctx.get_ca_certs()
    assert dict(x[0] for x in ca["subject"])["commonName"].startswith("quantloop: a CA")
    assert ctx.verify_mode == ssl.CERT_REQUIRED  # it verifies, against this one only


def test_pointing_at_a_plain_http_api_sets_it_for_children_and_prefect_and_undoes_it(
    tmp_path, monkeypatch
):
    from prefect.settings import get_current_settings

    monkeypatch.delenv("PREFECT_API_SSL_CERT_FILE", raising=False)
    before = get_current_settings().api.ssl_cert_file
    handle = ApiHandle(tmp_path / "home", print, None, 60.0)
    handle._point("http://127.0.0.1:4999/api", None)
    try:
        assert os.environ["PREFECT_API_SSL_CERT_FILE"] == str(PLAIN_HTTP_CA)
        assert get_current_settings().api.ssl_cert_file == str(PLAIN_HTTP_CA)
    finally:
        handle._unpoint()
    assert "PREFECT_API_SSL_CERT_FILE" not in os.environ
    assert get_current_settings().api.ssl_cert_file == before


@pytest.mark.slow
@pytest.mark.server
def test_prefects_client_loads_the_one_certificate_and_talks_to_a_real_server(
    prefect_api, monkeypatch
):
    from prefect.client.orchestration import get_client

    from quantloop.tasks.runtime.prefect_settings import overridden

    assert prefect_api.startswith("http://")
    loaded: list[str | None] = []
    real = ssl.create_default_context

    def watched(*args, **kwargs):
        loaded.append(kwargs.get("cafile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", watched)
    cert = plain_http_tls(prefect_api, {})["PREFECT_API_SSL_CERT_FILE"]
    with overridden({"api.ssl_cert_file": cert}), get_client(sync_client=True) as client:
        assert client.api_healthcheck() is None  # None: healthy
    assert loaded == [str(PLAIN_HTTP_CA)]

"""Tenants and keys: keys from config digests and from the environment, both header forms, the
401/403 answers in the OpenAI shape, per-tenant namespaces and cache salts, no secrets in logs."""

from __future__ import annotations

import logging

import orjson
import pytest

from gateway.api.errors import to_api_error
from gateway.config import ConfigError, load_config
from gateway.errors import NotAuthenticated, NotPermitted
from gateway.service.tenants import ADMIN, ANONYMOUS, TenantRegistry, key_digest

ACME_KEY = "sk-acme-0123456789"
BETA_KEY = "sk-beta-from-env-42"
ADMIN_KEY = "sk-admin-secret-77"


def auth(**kw: object) -> dict[str, object]:
    return {
        "tenants": [
            {
                "name": "acme",
                "key_sha256": [key_digest(ACME_KEY)],
                "models": ["m"],
                "max_concurrent": 2,
            },
            {"name": "beta", "key_env": ["BETA_KEY"], "requests_per_s": 5},
        ],
        "admin_key_env": ["ADMIN_KEY"],
        **kw,
    }


@pytest.fixture
def reg(caplog: pytest.LogCaptureFixture) -> TenantRegistry:
    config = load_config(None, auth=auth())
    with caplog.at_level(logging.INFO, logger="agentgw.tenants"):
        return TenantRegistry.from_config(config.auth, environ={"BETA_KEY": BETA_KEY, "ADMIN_KEY": ADMIN_KEY})


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


def test_keys_from_config_digest_and_environment_in_both_header_forms(reg: TenantRegistry) -> None:
    assert not reg.open
    assert reg.authenticate(bearer(ACME_KEY)).name == "acme"
    assert reg.authenticate([(b"x-api-key", BETA_KEY.encode())]).name == "beta"
    assert reg.authenticate([(b"Authorization", f"bearer  {BETA_KEY}".encode())]).name == "beta"
    assert reg.authenticate(bearer(ADMIN_KEY)) is ADMIN
    assert reg.is_admin([(b"x-api-key", ADMIN_KEY.encode())])
    assert not reg.is_admin(bearer(ACME_KEY))


def test_missing_or_wrong_key_is_401_and_tenant_key_on_admin_route_403(reg: TenantRegistry) -> None:
    for headers, code in (
        ([], "missing_api_key"),
        (bearer("sk-wrong"), "invalid_api_key"),
        ([(b"authorization", b"Basic abc")], "missing_api_key"),
        (bearer("x" * 10_000), "invalid_api_key"),
    ):
        with pytest.raises(NotAuthenticated) as e:
            reg.authenticate(headers)
        answer = to_api_error(e.value)  # the edge's rendering
        assert (answer.status, answer.code) == (401, code)
        err = orjson.loads(answer.body())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "authentication_error"
    with pytest.raises(NotPermitted) as n:
        reg.require_admin(bearer(ACME_KEY))
    assert (to_api_error(n.value).status, n.value.code) == (403, "admin_required")
    reg.require_admin(bearer(ADMIN_KEY))


def test_namespaces_and_cache_salts_keep_tenants_apart(reg: TenantRegistry) -> None:
    acme, beta = reg.authenticate(bearer(ACME_KEY)), reg.authenticate(bearer(BETA_KEY))
    assert acme.namespace("alice@example.com") == "acme:alice@example.com"
    assert acme.namespace("s") != beta.namespace("s")
    assert acme.local_id(acme.namespace("s")) == "s"
    assert beta.local_id(acme.namespace("s")) is None
    assert ADMIN.namespace("acme:s") == "acme:s"  # admins address stored ids
    assert acme.cache_salt and beta.cache_salt and acme.cache_salt != beta.cache_salt
    # stable across registries (replicas) built from the same config
    again = TenantRegistry.from_config(
        load_config(None, auth=auth()).auth, environ={"BETA_KEY": BETA_KEY, "ADMIN_KEY": ADMIN_KEY}
    )
    assert again.authenticate(bearer(ACME_KEY)).cache_salt == acme.cache_salt
    salted = TenantRegistry.from_config(
        load_config(None, auth=auth(cache_salt_secret_env="SALT")).auth,
        environ={"BETA_KEY": BETA_KEY, "ADMIN_KEY": ADMIN_KEY, "SALT": "s3cret"},
    )
    assert salted.authenticate(bearer(ACME_KEY)).cache_salt != acme.cache_salt


def test_allowed_models(reg: TenantRegistry) -> None:
    acme = reg.authenticate(bearer(ACME_KEY))
    acme.check_model("m")
    with pytest.raises(NotPermitted) as e:
        acme.check_model("other")
    answer = to_api_error(e.value)
    assert (answer.status, answer.param, answer.code) == (403, "model", "model_not_allowed")
    reg.authenticate(bearer(BETA_KEY)).check_model("anything")


def test_no_secret_in_logs(reg: TenantRegistry, caplog: pytest.LogCaptureFixture) -> None:
    text = "\n".join(r.getMessage() for r in caplog.get_records("setup"))
    assert "API keys required: 2 tenant(s)" in text
    for secret in (ACME_KEY, BETA_KEY, ADMIN_KEY, key_digest(ACME_KEY)):
        assert secret not in text


def test_open_registry_without_keys_on_loopback_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agentgw.tenants"):
        reg = TenantRegistry.from_config(load_config(None).auth, "127.0.0.1", environ={})
    assert reg.open and reg.authenticate([]) is ANONYMOUS and reg.is_admin([])
    reg.require_admin([])  # admin routes are open too
    assert ANONYMOUS.namespace("s") == "s" and ANONYMOUS.cache_salt is None
    assert "WITHOUT API keys" in caplog.text
    with pytest.raises(ConfigError, match="not loopback"):
        load_config(None, listen={"host": "0.0.0.0", "port": 8000})
    load_config(None, listen={"host": "0.0.0.0", "port": 8000}, auth={"allow_unauthenticated": True})
    load_config(None, listen={"host": "0.0.0.0", "port": 8000}, auth=auth())


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"auth\.tenants\.0\.key_sha256"):
        load_config(None, auth={"tenants": [{"name": "a", "key_sha256": ["abc"]}]})
    with pytest.raises(ConfigError, match=r"'auth\.tenants\.1\.key_env': environment variable BETA_KEY"):
        TenantRegistry.from_config(load_config(None, auth=auth()).auth, environ={"ADMIN_KEY": "x"})
    with pytest.raises(ConfigError, match="tenant names must be unique"):
        load_config(None, auth={"tenants": [{"name": "a"}, {"name": "a"}]})

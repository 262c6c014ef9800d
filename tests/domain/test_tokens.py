from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.domain import tokens

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KEY = tokens.SigningKey("0123456789abcdef", b"k" * 32)
OTHER = tokens.SigningKey("fedcba9876543210", b"o" * 32)


def test_s15_opaque_tokens_are_typed_random_and_stored_hashed() -> None:
    first = tokens.new_opaque(tokens.Kind.MANUAL_REGISTRATION)
    second = tokens.new_opaque(tokens.Kind.MANUAL_REGISTRATION)
    assert first.raw != second.raw
    assert first.raw.startswith("cp_mrt_") and len(first.raw) == len("cp_mrt_") + 43
    assert first.sha256 == tokens.digest(first.raw) and len(first.sha256) == 64
    assert first.raw not in first.sha256
    assert first.display_prefix == first.raw[:12]


def test_a_token_of_one_kind_is_refused_as_another() -> None:
    manual = tokens.new_opaque(tokens.Kind.MANUAL_REGISTRATION)
    assert tokens.parse_opaque(manual.raw, tokens.Kind.MANUAL_REGISTRATION) == manual.sha256
    with pytest.raises(tokens.TokenError):
        tokens.parse_opaque(manual.raw, tokens.Kind.PROVISIONER)
    for junk in ["", "cp_mrt_", "cp_mrt_short", "sf_mrt_" + "a" * 43, "cp_xyz_" + "a" * 43]:
        with pytest.raises(tokens.TokenError):
            tokens.parse_opaque(junk, tokens.Kind.MANUAL_REGISTRATION)


def test_signed_token_round_trip_and_expiry() -> None:
    token = tokens.sign(tokens.Kind.JOB_LEASE, {"ex": "e1"}, KEY, NOW + timedelta(seconds=60))
    keys = {KEY.kid: KEY}
    assert tokens.verify(token, tokens.Kind.JOB_LEASE, keys, NOW)["ex"] == "e1"
    with pytest.raises(tokens.TokenError, match="expired"):
        tokens.verify(token, tokens.Kind.JOB_LEASE, keys, NOW + timedelta(seconds=60))


def test_signed_token_refuses_other_kind_forgery_and_unknown_key() -> None:
    token = tokens.sign(tokens.Kind.RUNNER_SESSION, {"sid": "s"}, KEY, NOW + timedelta(hours=1))
    keys = {KEY.kid: KEY}
    with pytest.raises(tokens.TokenError):
        tokens.verify(token, tokens.Kind.JOB_LEASE, keys, NOW)
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    with pytest.raises(tokens.TokenError):
        tokens.verify(forged, tokens.Kind.RUNNER_SESSION, keys, NOW)
    with pytest.raises(tokens.TokenError, match="unknown signing key"):
        tokens.verify(token, tokens.Kind.RUNNER_SESSION, {OTHER.kid: OTHER}, NOW)
    # Same key id but another secret: the MAC does not verify.
    impostor = tokens.SigningKey(KEY.kid, b"x" * 32)
    with pytest.raises(tokens.TokenError, match="bad signature"):
        tokens.verify(token, tokens.Kind.RUNNER_SESSION, {KEY.kid: impostor}, NOW)


def test_rotation_old_key_still_verifies() -> None:
    old = tokens.sign(tokens.Kind.RUNNER_SESSION, {"sid": "s"}, KEY, NOW + timedelta(hours=1))
    new = tokens.sign(tokens.Kind.RUNNER_SESSION, {"sid": "s"}, OTHER, NOW + timedelta(hours=1))
    keys = {KEY.kid: KEY, OTHER.kid: OTHER}
    assert tokens.verify(old, tokens.Kind.RUNNER_SESSION, keys, NOW)["sid"] == "s"
    assert tokens.verify(new, tokens.Kind.RUNNER_SESSION, keys, NOW)["sid"] == "s"

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from controlplane import settings
from controlplane.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[1] / "config" / "controlplane.toml"


def _knobs() -> list[tuple[str, str]]:
    return [
        (section.name, knob.name)
        for section in msgspec.structs.fields(settings.Settings)
        for knob in msgspec.structs.fields(section.type)
    ]


def test_config_file_documents_every_knob_with_its_default() -> None:
    documented = tomllib.loads(CONFIG.read_text())
    defaults = msgspec.to_builtins(settings.Settings())
    for section, knob in _knobs():
        assert knob in documented[section], f"{section}.{knob} missing from {CONFIG.name}"
        assert documented[section][knob] == defaults[section][knob], f"{section}.{knob}"
    assert settings.load(CONFIG, environ={}) == settings.Settings()


def test_environment_overrides_file_and_database_url_alias() -> None:
    loaded = settings.load(
        CONFIG,
        environ={"CONTROLPLANE_SERVER_PORT": "9001", "DATABASE_URL": "postgresql://x/y"},
    )
    assert loaded.server.port == 9001
    assert loaded.database.url == "postgresql://x/y"


@pytest.mark.parametrize(("section", "knob"), _knobs())
def test_s94_every_numeric_knob_refuses_an_invalid_value_naming_it(section: str, knob: str) -> None:
    default = getattr(getattr(settings.Settings(), section), knob)
    text_bad = {
        "reserved_labels": "has space",
        "url": "mysql://nope",
        "embedded_data_dir": " ",
        "host": "not a host",
    }
    bad = text_bad[knob] if isinstance(default, str) else "-1000000000"
    env = {f"CONTROLPLANE_{section.upper()}_{knob.upper()}": bad}
    with pytest.raises(ConfigError, match=f"{section}.{knob}"):
        settings.load(environ=env)


def test_cross_knob_rules() -> None:
    with pytest.raises(ConfigError, match="no_first_heartbeat_grace_seconds"):
        settings.load(environ={"CONTROLPLANE_RUNNERS_NO_FIRST_HEARTBEAT_GRACE_SECONDS": "180"})
    with pytest.raises(ConfigError, match="pool_min_size"):
        settings.load(environ={"CONTROLPLANE_DATABASE_POOL_MIN_SIZE": "50"})
    with pytest.raises(ConfigError, match="heartbeat_interval_seconds"):
        settings.load(environ={"CONTROLPLANE_RUNNERS_HEARTBEAT_INTERVAL_SECONDS": "100"})


def test_j133_s97_grace_values() -> None:
    for bad in ["0", "-5", "1.5", "180"]:
        with pytest.raises(ConfigError, match="no_first_heartbeat_grace_seconds"):
            settings.load(environ={"CONTROLPLANE_RUNNERS_NO_FIRST_HEARTBEAT_GRACE_SECONDS": bad})
    ok = settings.load(environ={"CONTROLPLANE_RUNNERS_NO_FIRST_HEARTBEAT_GRACE_SECONDS": "60"})
    assert ok.runners.no_first_heartbeat_grace_seconds == 60


def test_unknown_environment_setting_and_bad_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CONTROLPLANE_SERVER_PROT"):
        settings.load(environ={"CONTROLPLANE_SERVER_PROT": "1"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="prot"):
        settings.load(bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        settings.load(tmp_path / "missing.toml", environ={})


@pytest.mark.parametrize(
    "knob",
    [
        "BOOTSTRAP_TOKEN_TTL_SECONDS",
        "CONTROL_SESSION_TTL_SECONDS",
        "ACTIVATION_TOKEN_TTL_SECONDS",
        "EPHEMERAL_TOKEN_TTL_SECONDS",
        "RESERVATION_TTL_MAX_SECONDS",
    ],
)
def test_s95_token_and_reservation_lifetimes_above_an_hour_are_refused(knob: str) -> None:
    with pytest.raises(ConfigError, match=f"provisioners.{knob.lower()}"):
        settings.load(environ={f"CONTROLPLANE_PROVISIONERS_{knob}": "3601"})
    ok = settings.load(environ={f"CONTROLPLANE_PROVISIONERS_{knob}": "3600"})
    assert getattr(ok.provisioners, knob.lower()) == 3600


def test_s96_the_default_lifetime_may_not_exceed_the_ceiling() -> None:
    with pytest.raises(ConfigError, match="reservation_ttl_seconds must not exceed"):
        settings.load(
            environ={
                "CONTROLPLANE_PROVISIONERS_RESERVATION_TTL_SECONDS": "120",
                "CONTROLPLANE_PROVISIONERS_RESERVATION_TTL_MAX_SECONDS": "100",
            }
        )


@pytest.mark.parametrize(
    "throttle", ["PROVISIONERS_LAST_SEEN_THROTTLE_SECONDS", "RUNNERS_LIVENESS_THROTTLE_SECONDS"]
)
def test_s98_the_stale_runner_threshold_must_exceed_both_throttles(throttle: str) -> None:
    env = {"CONTROLPLANE_PROVISIONERS_STALE_RUNNER_THRESHOLD_SECONDS": "60"}
    with pytest.raises(ConfigError, match="stale_runner_threshold_seconds must exceed"):
        settings.load(environ={**env, f"CONTROLPLANE_{throttle}": "60"})
    assert settings.load(environ={**env, f"CONTROLPLANE_{throttle}": "59"})


def test_s100_the_assignment_wait_must_be_at_least_a_second() -> None:
    with pytest.raises(ConfigError, match="assignment_poll_max_wait_seconds"):
        settings.load(environ={"CONTROLPLANE_PROVISIONERS_ASSIGNMENT_POLL_MAX_WAIT_SECONDS": "0"})


def test_the_client_commands_variables_do_not_trip_the_server() -> None:
    """A shell that sourced var/dev.env holds every client variable; the server ignores them."""
    environ = dict.fromkeys(settings.CLIENT_VARIABLES, "x")
    assert settings.load(environ=environ) == settings.load(environ={})


def test_a_mistyped_setting_is_still_refused() -> None:
    environ = dict.fromkeys(settings.CLIENT_VARIABLES, "x")
    with pytest.raises(ConfigError, match="CONTROLPLANE_SERVER_PROT"):
        settings.load(environ={**environ, "CONTROLPLANE_SERVER_PROT": "9000"})


def test_every_variable_a_command_reads_is_a_setting_or_declared_for_clients() -> None:
    """The clients' variables are named in source; each must be known to the settings loader,
    or a shell that exports it could not start a server."""
    package = Path(settings.__file__).parent
    sources = [
        package / "dev.py",
        *sorted((package / "cli").glob("*.py")),
        *sorted((package / "agent").glob("*.py")),
    ]
    named = {
        name
        for source in sources
        for name in re.findall(r"\bCONTROLPLANE_[A-Z_]+\b", source.read_text())
    }
    assert named, "no variable found: the pattern is wrong"
    for name in sorted(named - settings.CLIENT_VARIABLES - {"CONTROLPLANE_CONFIG"}):
        assert _is_setting(name), f"{name} is read by a command but unknown to the settings"


def _is_setting(name: str) -> bool:
    section, _, knob = name.removeprefix("CONTROLPLANE_").lower().partition("_")
    fields = {f.name: f.type for f in msgspec.structs.fields(settings.Settings)}
    return section in fields and knob in {f.name for f in msgspec.structs.fields(fields[section])}


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[serverr]\nport = 1\n", "invalid setting: Object contains unknown field `serverr`"),
        ("[server]\nprot = 1\n", "invalid setting: server: Object contains unknown field `prot`"),
        ('[server]\nport = "x"\n', "invalid setting: server.port: Expected `int`, got `str`"),
    ],
)
def test_a_bad_config_file_is_named_plainly(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as refused:
        settings.load(path, environ={})
    assert refused.value.message == message

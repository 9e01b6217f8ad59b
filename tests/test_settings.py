"""kvserve_launch.settings: the one way every process reads its flags and variables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvserve_launch.settings import Flag, Settings

PREFIX = "KVTEST_"


@dataclass(frozen=True, slots=True)
class Config:
    port: int = 50051
    ratio: float = 0.5
    name: str = "x"
    token: str = ""
    warmup: bool = True
    caching: bool = True
    block_size: int | None = None
    pending: int | None = None
    workers: tuple[str, ...] = ()
    internal: str = "not a flag"


SETTINGS = Settings(
    Config,
    PREFIX,
    prog="test",
    description="a test",
    flags={
        "port": "a port",
        "ratio": "a ratio (50%)",
        "name": "a name",
        "token": Flag("a token", secret=True),
        "warmup": "warm up",
        "caching": Flag("no caching", off_only=True),
        "block_size": Flag("0: any", none_as=0),
        "pending": "0: no limit",
        "workers": "comma-separated",
    },
)


@pytest.fixture(autouse=True)
def no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (
        "PORT",
        "RATIO",
        "NAME",
        "TOKEN",
        "WARMUP",
        "CACHING",
        "BLOCK_SIZE",
        "PENDING",
        "WORKERS",
        "INTERNAL",
    ):
        monkeypatch.delenv(PREFIX + key, raising=False)


def test_defaults_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SETTINGS.parse([]) == Config()
    monkeypatch.setenv("KVTEST_PORT", "7")
    monkeypatch.setenv("KVTEST_WORKERS", " a:1, b:2,, ")
    monkeypatch.setenv("KVTEST_INTERNAL", "ignored")
    config = SETTINGS.parse([])
    assert (config.port, config.workers, config.internal) == (7, ("a:1", "b:2"), "not a flag")
    assert SETTINGS.parse(["--port", "8", "--ratio", "0.25"]).port == 8  # the flag wins


@pytest.mark.parametrize(
    ("value", "on"),
    [("0", False), ("false", False), ("OFF", False), ("No", False), ("1", True), ("yes", True)],
)
def test_booleans_read_one_way(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTEST_WARMUP", value)
    monkeypatch.setenv("KVTEST_CACHING", value)
    config = SETTINGS.parse([])
    assert (config.warmup, config.caching) == (on, on)
    assert SETTINGS.parse(["--warmup"]).warmup is True
    assert SETTINGS.parse(["--no-warmup", "--no-caching"]) == Config(warmup=False, caching=False)


def test_off_only_has_no_on_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        SETTINGS.parse(["--caching"])
    assert "unrecognized arguments: --caching" in capsys.readouterr().err


def test_optional_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SETTINGS.parse(["--block-size", "0", "--pending", "0"]).block_size is None
    assert SETTINGS.parse(["--pending", "0"]).pending == 0
    assert SETTINGS.parse(["--block-size", "16"]).block_size == 16
    monkeypatch.setenv("KVTEST_PENDING", "")  # empty: unset
    assert SETTINGS.parse([]).pending is None


def test_a_bad_variable_is_refused_like_the_flag_unless_a_flag_overrides_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTEST_PORT", "abc")
    with pytest.raises(SystemExit) as exit:
        SETTINGS.parse([])
    assert exit.value.code == 2
    assert "argument --port: invalid int value: 'abc'" in capsys.readouterr().err
    assert SETTINGS.parse(["--port", "9"]).port == 9


def test_check_answers_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        SETTINGS.parse(["--port", "0"], lambda c: "--port must be positive" if c.port < 1 else None)
    assert exit.value.code == 2
    assert "test: error: --port must be positive" in capsys.readouterr().err


def test_help_shows_defaults_and_hides_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTEST_TOKEN", "s3cret")
    with pytest.raises(SystemExit):
        SETTINGS.parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a port (default: 50051)" in text
    assert "a ratio (50%) (default: 0.5)" in text
    assert "warm up (default: on)" in text
    assert "0: any (default: 0)" in text
    assert "s3cret" not in text and "--internal" not in text


def test_the_table_must_name_fields_of_readable_types() -> None:
    with pytest.raises(TypeError, match="no field"):
        Settings(Config, PREFIX, "p", "d", {"nope": "help"})

    @dataclass(frozen=True)
    class Odd:
        values: list[int]

    with pytest.raises(TypeError, match="no flag reads"):
        Settings(Odd, PREFIX, "p", "d", {"values": "help"})

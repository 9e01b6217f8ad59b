"""Every process's config from flags and environment variables, by one set of rules.

A process's config is a frozen dataclass; :class:`Settings` turns it into a command line from a
table of its fields' help (docs/configuration.md lists the same flags)::

    field lease_ttl_s  ->  flag --lease-ttl-s  ->  variable KVCACHE_LEASE_TTL_S

A flag given on the command line wins over the variable, the variable over the dataclass's
default. The field's type says how a value is read:

- ``str``, ``int``, ``float``: as argparse reads them. A bad value in a variable is refused
  the way the same flag's is (``argument --port: invalid int value: 'x'``), and only when no
  flag overrides it.
- ``bool``: ``--x`` and ``--no-x`` (or only ``--no-x``, :attr:`Flag.off_only`); the variable
  is off for ``0``, ``false``, ``no`` or ``off`` (any case), on for anything else.
- ``tuple[str, ...]``: comma-separated, blanks dropped.
- ``X | None``: None where unset; an empty variable is unset; :attr:`Flag.none_as` names the
  value that stands for None on the command line too (``--block-size 0``).

Fields missing from the table are not flags (they keep their default). ``--help`` shows each
flag's default from the dataclass, never a secret's. Checks across fields are the config
module's: a function from the config to the first problem, answered like argparse's own errors
(exit status 2, ``<prog>: error: <problem>``).

Standard library only: every process imports it, the cache service included.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

C = TypeVar("C")

OFF = ("0", "false", "no", "off")


def flag_of(name: str) -> str:
    """The flag of config field ``name``: ``--lease-ttl-s``."""
    return "--" + name.replace("_", "-")


def variable_of(prefix: str, name: str) -> str:
    """The environment variable of config field ``name``: ``KVCACHE_LEASE_TTL_S``."""
    return prefix + name.upper()


def is_on(value: str) -> bool:
    """A boolean variable's value: off for 0, false, no, off (any case); on otherwise."""
    return value.lower() not in OFF


def comma_separated(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


@dataclass(frozen=True, slots=True)
class Flag:
    """One field's entry in a settings table, where a plain help string does not say enough."""

    help: str
    # Never shown by --help, even as a default: tokens and keys.
    secret: bool = False
    # For an ``X | None`` field: the value that means None, on the command line and in the
    # variable (--help shows it as the default).
    none_as: object = None
    # For a bool field that is on by default: only ``--no-<name>``, no ``--<name>``.
    off_only: bool = False


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: type  # str, int, float, bool or tuple (of str)
    optional: bool
    default: Any
    flag: Flag


def _kind(cls: type, name: str, hint: object) -> tuple[type, bool]:
    """(the type a value is read as, whether None is allowed) of a field's annotation."""
    optional = False
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            hint, optional = args[0], True
    if hint in (str, int, float, bool) and not (optional and hint is bool):
        return hint, optional
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...) and not optional:
        return tuple, False
    raise TypeError(f"{cls.__name__}.{name}: no flag reads a {hint}")


class Settings(Generic[C]):
    """The command line of config dataclass ``config``: a flag and a variable per field of
    ``flags`` (field name to help, or to a :class:`Flag`), in the table's order."""

    def __init__(
        self,
        config: type[C],
        prefix: str,
        prog: str,
        description: str,
        flags: Mapping[str, str | Flag],
    ) -> None:
        self.config = config
        self.prefix = prefix
        self.prog = prog
        self.description = description
        hints = typing.get_type_hints(config)
        defaults = {f.name: f.default for f in dataclasses.fields(config)}  # type: ignore[arg-type]
        self.fields: list[_Field] = []
        for name, entry in flags.items():
            if name not in defaults:
                raise TypeError(f"{config.__name__} has no field {name!r}")
            flag = entry if isinstance(entry, Flag) else Flag(entry)
            kind, optional = _kind(config, name, hints[name])
            if flag.off_only and not (kind is bool and defaults[name] is True):
                raise TypeError(f"{config.__name__}.{name}: off_only needs a bool that is on")
            self.fields.append(_Field(name, kind, optional, defaults[name], flag))

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=self.prog, description=self.description)
        for f in self.fields:
            self._add(p, f)
        return p

    def parse(
        self, argv: Sequence[str] | None = None, check: Callable[[C], str | None] | None = None
    ) -> C:
        """The config from ``argv`` (default: ``sys.argv[1:]``) and the environment; a bad
        flag or variable, or a ``check`` that names a problem, exits as argparse does."""
        p = self.parser()
        values = vars(p.parse_args(argv))
        for f in self.fields:
            if f.optional and values[f.name] == f.flag.none_as:
                values[f.name] = None
        config = self.config(**values)
        if check is not None and (problem := check(config)):
            p.error(problem)
        return config

    def _add(self, p: argparse.ArgumentParser, f: _Field) -> None:
        flag, help = flag_of(f.name), f.flag.help.replace("%", "%%")  # argparse formats help
        variable = os.environ.get(variable_of(self.prefix, f.name))
        if f.kind is bool:
            on = f.default if variable is None else is_on(variable)
            if f.flag.off_only:
                no = "--no-" + flag[2:]
                p.add_argument(no, dest=f.name, action="store_false", default=on, help=help)
            else:
                shown = f"{help} (default: {'on' if f.default else 'off'})"
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=on, help=shown)
            return
        default: Any = f.flag.none_as if f.optional and f.default is None else f.default
        if f.kind is tuple:
            default = ",".join(default)
        if default not in ("", None) and not f.flag.secret:
            help = f"{help} (default: {str(default).replace('%', '%%')})"
        if variable is not None and not (f.optional and variable == ""):
            # A string default goes through ``type`` as a flag's value would, errors included,
            # and only when no flag is given.
            default = variable
        kind = comma_separated if f.kind is tuple else f.kind
        p.add_argument(flag, type=kind, default=default, help=help)


def new_token(nbytes: int = 18) -> str:
    """A random bearer token for a service that was given none: hex, so it never starts with
    ``-`` (a URL-safe token did one time in 64, and ``--token <it>`` then read as an option in
    every CLI the banner told the operator to run)."""
    return secrets.token_hex(nbytes)

"""Command-line flags and environment variables derived from typed settings: the one loader.

Each command declares its settings once, as a pydantic model made of the core's settings
(:mod:`diloco_core.config`) and fields of its own. :func:`derive_flags` turns the model's fields into
flags (``inner_steps`` → ``--inner-steps``; a field of a nested section, ``model.n_layer``, →
``--n-layer``) and environment variables (``DILOCO_INNER_STEPS``); :func:`read` collects what the
command line and the environment give, and :func:`validate` builds the settings: a flag wins over
its variable, which wins over a base (a ``--job-config`` file), which wins over the model's defaults.
Values reach the model as text, so the constraints written on its fields judge them, and the one
rendering of validation errors (:mod:`diloco_core.validation_errors`) names each setting and where
its value came from.

``Annotated[..., Cli(...)]`` on a field renames its flag, gives it a short form, or marks it secret
(its value never appears in a message; ``SecretStr`` fields are secret anyway). Booleans get
``--x``/``--no-x`` and read ``DILOCO_X=true|false`` or ``DILOCO_NO_X=true|false``; tuples take
comma-separated values (and the flag may repeat). An empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from diloco_core.validation_errors import describe_errors, dotted

ENV_PREFIX = "DILOCO_"
M = TypeVar("M", bound=BaseModel)
FieldPath = tuple[str, ...]
Kind = Literal["value", "bool", "list"]
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


class SettingsError(ValueError):
    """Settings that can never work; the message names each setting, where its value came from and
    what is wrong with it."""


@dataclass(frozen=True)
class Cli:
    """How a settings field appears on the command line when not simply as ``--field-name``."""

    name: str | None = None
    """The flag without its dashes; the variable is ``DILOCO_`` + the name in upper case."""
    short: str | None = None
    secret: bool = False


@dataclass(frozen=True)
class Flag:
    """One settings field on the command line and in the environment."""

    path: FieldPath
    name: str
    kind: Kind
    help: str
    short: str | None = None
    secret: bool = False
    env_prefix: str = ENV_PREFIX

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return self.env_prefix + self.dest.upper()

    @property
    def negative_env(self) -> str:
        return f"{self.env_prefix}NO_{self.dest.upper()}"


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _optional_of(annotation: Any) -> Any:
    """``X`` for ``X | None``, else the annotation itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _kind(annotation: Any) -> Kind:
    base = _optional_of(annotation)
    if base is bool:
        return "bool"
    if typing.get_origin(base) in (tuple, list):
        return "list"
    return "value"


def _cli(info: FieldInfo) -> Cli:
    found = [m for m in info.metadata if isinstance(m, Cli)]
    return found[0] if found else Cli()


def _show(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return str(value)


def _help(info: FieldInfo, default: Any, secret: bool, description: str | None = None) -> str:
    parts = [description or info.description or ""]
    choices = typing.get_args(_optional_of(info.annotation))
    if typing.get_origin(_optional_of(info.annotation)) is Literal:
        parts.append("one of " + ", ".join(str(c) for c in choices))
    unset = default is PydanticUndefined or default is None or default is False or default == ()
    if not unset and not secret:
        parts.append(f"(default {str(default).lower() if default is True else _show(default)})")
    return " ".join(p for p in parts if p).replace("%", "%%")


def _walk(model: type[BaseModel], path: str) -> tuple[type[BaseModel], BaseModel | None]:
    """The class of the section at dotted ``path`` and its default value, when one is declared."""
    cls, default = model, None
    for part in [p for p in path.split(".") if p]:
        info = cls.model_fields[part]
        section = _section(info.annotation)
        if section is None:
            raise ValueError(f"{path}: {part} is not a section of settings")
        if default is not None:
            default = getattr(default, part)
        elif isinstance(info.default, BaseModel):
            default = info.default
        cls = section
    return cls, default


def derive_flags(
    model: type[BaseModel],
    include: Mapping[str, Collection[str] | None],
    *,
    exclude: Collection[str] = (),
    env_prefix: str = ENV_PREFIX,
    help: Mapping[str, str] | None = None,
) -> tuple[Flag, ...]:
    """The flags of ``model``'s leaf fields named by ``include``.

    ``include`` maps a section's dotted path ("" for the model itself, "job.diloco" for a nested one)
    to the names of its fields that get flags (None: every field that is not itself a section);
    ``exclude`` names dotted field paths left out; ``help`` replaces the description of a flag (by
    its name). The help shows the default as the model declares it, which for a field of a section
    is that section's declared default. Two flags with one name are an error.
    """
    flags: list[Flag] = []
    for section_path, names in include.items():
        cls, section_default = _walk(model, section_path)
        prefix: FieldPath = tuple(p for p in section_path.split(".") if p)
        chosen = (
            names
            if names is not None
            else [n for n, f in cls.model_fields.items() if _section(f.annotation) is None]
        )
        for name in chosen:
            info = cls.model_fields[name]
            path = (*prefix, name)
            if ".".join(path) in exclude:
                continue
            cli = _cli(info)
            secret = cli.secret or _optional_of(info.annotation) is SecretStr
            default = getattr(section_default, name) if section_default is not None else info.default
            flag_name = cli.name or name.replace("_", "-")
            text = _help(info, default, secret, (help or {}).get(flag_name))
            flags.append(Flag(path, flag_name, _kind(info.annotation), text, cli.short, secret, env_prefix))
    names_seen = [f.name for f in flags]
    twice = sorted({n for n in names_seen if names_seen.count(n) > 1})
    if twice:
        raise ValueError(
            f"two settings would share the flag(s) {', '.join(twice)}: rename one with Cli(name=...)"
        )
    return tuple(flags)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[Flag]) -> None:
    """Add ``flags`` to ``parser``; each defaults to None, so :func:`read` can tell "not given"."""
    for f in flags:
        names = [f.option, *([f.short] if f.short else [])]
        if f.kind == "bool":
            parser.add_argument(
                *names, dest=f.dest, action=argparse.BooleanOptionalAction, default=None, help=f.help
            )
        elif f.kind == "list":
            parser.add_argument(
                *names, dest=f.dest, action="append", default=None, metavar="A,B", help=f.help
            )
        else:
            parser.add_argument(*names, dest=f.dest, default=None, help=f.help)


def _split(values: str | Sequence[str]) -> list[str]:
    texts = [values] if isinstance(values, str) else list(values)
    return [part.strip() for text in texts for part in text.split(",") if part.strip()]


@dataclass
class Given:
    """What the command line and the environment set: nested raw values and where each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[FieldPath, str] = field(default_factory=dict)

    def set(self, path: FieldPath, value: Any, source: str) -> None:
        node = self.values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        self.sources[path] = source

    def has(self, path: FieldPath) -> bool:
        return path in self.sources


def option_or_env(
    args: argparse.Namespace, environ: Mapping[str, str], name: str, prefix: str = ENV_PREFIX
) -> Any:
    """The value of a plain argument ``--name`` (not a settings field), else of its variable."""
    value = getattr(args, name.replace("-", "_"), None)
    if value is not None:
        return value
    text = environ.get(prefix + name.replace("-", "_").upper(), "")
    return text or None


def read(flags: Iterable[Flag], args: argparse.Namespace, environ: Mapping[str, str]) -> Given:
    """What the flags in ``args`` and their variables in ``environ`` set (a flag wins)."""
    given = Given()
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is not None:
            if f.kind == "bool":
                source = f.option if value else f"--no-{f.name}"
            else:
                source = f.option if f.secret else f"{f.option}={_show(value)}"
        else:
            value, source = _from_env(f, environ)
            if value is None:
                continue
        given.set(f.path, _split(value) if f.kind == "list" else value, source)
    return given


def _from_env(f: Flag, environ: Mapping[str, str]) -> tuple[Any, str]:
    text = environ.get(f.env, "")
    if text:
        return text, f.env if f.secret else f"{f.env}={text!r}"
    negative = environ.get(f.negative_env, "") if f.kind == "bool" else ""
    if negative:
        try:
            return not _BOOL.validate_python(negative), f"{f.negative_env}={negative!r}"
        except ValidationError:
            raise SettingsError(f"{f.negative_env}={negative!r}: expected true or false") from None
    return None, ""


def unknown_variables(
    flags: Iterable[Flag], environ: Mapping[str, str], prefix: str, known: Collection[str] = ()
) -> list[str]:
    """Variables with ``prefix`` that no flag reads (a misspelt setting), besides ``known`` ones."""
    read_by = {name for f in flags for name in (f.env, f.negative_env)} | set(known)
    return sorted(k for k in environ if k.startswith(prefix) and k not in read_by)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _declared_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The sections whose default the model declares (``diloco: DiLoCoSettings = DiLoCoSettings(H=16)``),
    so that setting one field of such a section keeps the declared values of the others."""
    return {
        n: f.default.model_dump() for n, f in model.model_fields.items() if isinstance(f.default, BaseModel)
    }


def _lookup(values: Mapping[str, Any], path: FieldPath) -> bool:
    node: Any = values
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def validate(
    model: type[M],
    given: Given,
    *,
    base: Mapping[str, Any] | None = None,
    base_source: str = "",
    what: str = "settings",
) -> M:
    """The settings from ``base`` overlaid with what was given; raises :class:`SettingsError`."""
    raw = _merge(_merge(_declared_defaults(model), base or {}), given.values)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        where = _where_given(given, base or {}, base_source)
        raise SettingsError(f"invalid {what}: {describe_errors(exc.errors(), where)}") from None


def _where_given(given: Given, base: Mapping[str, Any], base_source: str) -> Callable[[tuple[Any, ...]], str]:
    def where(loc: tuple[Any, ...]) -> str:
        if not loc:
            return ""  # a check of the whole: its message says what to change
        name = dotted(loc)
        path = tuple(str(p) for p in loc)
        for cut in range(len(path), 0, -1):
            if path[:cut] in given.sources:
                return f"{name} ({given.sources[path[:cut]]})"
        inside = [s for p, s in given.sources.items() if path and p[: len(path)] == path]
        if inside:
            return f"{name} (given: {', '.join(inside)})"
        if base_source and path and _lookup(base, path):
            return f"{name} (from {base_source})"
        return name

    return where


def _get(settings: BaseModel, path: FieldPath) -> Any:
    value: Any = settings
    for part in path:
        value = getattr(value, part)
    return value


def to_argv(flags: Iterable[Flag], settings: BaseModel) -> list[str]:
    """The arguments that give ``settings``' values of these flags (secrets left out: they travel in
    the environment, never on a command line)."""
    argv: list[str] = []
    for f in flags:
        value = _get(settings, f.path)
        if f.secret or value is None:
            continue
        if f.kind == "bool":
            argv.append(f.option if value else f"--no-{f.name}")
        else:
            argv += [f.option, _show(value)]
    return argv


def to_env(flags: Iterable[Flag], settings: BaseModel) -> dict[str, str]:
    """The variables that give ``settings``' values of these flags (None values left out)."""
    out: dict[str, str] = {}
    for f in flags:
        value = _get(settings, f.path)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        out[f.env] = str(value).lower() if isinstance(value, bool) else _show(value)
    return out


def read_document(text_or_path: str, what: str) -> dict[str, Any]:
    """A mapping from JSON text, or from a JSON or YAML file (its path, optionally after ``@``)."""
    try:
        if text_or_path.lstrip().startswith("{"):
            data = json.loads(text_or_path)
        else:
            path = Path(text_or_path.removeprefix("@"))
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read {what}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{what} must be a mapping (a JSON object), got {type(data).__name__}")
    return data

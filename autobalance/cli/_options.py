"""The flags of ``autobalance tune``, derived from the fields of :class:`TuneSettings`.

Every field is a flag ``--field-name`` (its study TOML key is the field name), its help is the
field's docstring and its default the field's default (or the docstring's ``(default: ...)`` text),
so flags, TOML keys and help cannot drift apart. Only the shape of a few fields on the command line
is written here: the positional SCRIPT, the script's own arguments after ``--``, a repeatable
``--torchrun-arg``, comma lists and one flag pair named differently."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import typer

from autobalance.cli._common import help_text, parse_floats, parse_list

__all__ = ["ARGUMENT", "EXTRA", "flag_of", "settings_from_command_line", "with_settings_options"]

ARGUMENT = "script"
"""The field given as the positional SCRIPT."""
EXTRA = "script_args"
"""The field given as everything after ``--`` (the script's own arguments)."""
DECLS: dict[str, tuple[str, ...]] = {
    "torchrun_args": ("--torchrun-arg",),  # repeatable: one torchrun option per flag
    "multi_objective": ("--multi-objective/--single-objective",),
}
"""Fields whose flags are not the plain ``--field-name`` (or ``--field-name/--no-field-name``)."""
FIELD_METAVARS = {"memory_cap": "SIZE|GPU[,...]"}
"""Fields whose value is not read the way their annotation's :data:`METAVARS` says."""
METAVARS = {"float | str | None": "DURATION", "list[float] | None": "X[,Y,...]", "list[str] | None": "A[,B,...]", "list[str]": "OPTION"}

_CLI_TYPES: dict[str, Any] = {
    "int": int, "int | None": int, "float": float, "float | None": float, "str": str, "str | None": str,
    "float | str": str, "float | str | None": str, "bool": bool, "list[float] | None": str, "list[str] | None": str, "list[str]": list[str],
}
"""The command-line type of each field annotation (lists of numbers or words are comma lists)."""


def flag_of(name: str) -> str:
    """The (first) command-line flag of a settings field."""
    if name in DECLS:
        return DECLS[name][0].split("/")[0]
    return "--" + name.replace("_", "-")


def _flags_named(text: str) -> str:
    """A field docstring for the command line: ``name`` of a field becomes its flag, other ``code`` plain."""
    names = {name for name, _ in _settings_fields()}
    return re.sub(r"``([^`]+)``", lambda m: flag_of(m[1]) if m[1] in names else m[1], text)


def _settings_fields() -> list[tuple[str, str]]:
    """Each settings field and its annotation as the command line reads it (a choice setting: ``str``)."""
    from autobalance.tuner import setting_types

    return list(setting_types().items())


def _parameter(name: str, annotation: str) -> inspect.Parameter:
    from autobalance.tuner import setting_docs

    doc = setting_docs()[name]
    if annotation not in _CLI_TYPES:
        raise AssertionError(f"TuneSettings.{name}: {annotation!r} has no command-line form; add it to _CLI_TYPES")
    cli_type = _CLI_TYPES[annotation]
    described = doc.value is None or doc.value == "" or doc.value == []
    kind = inspect.Parameter.KEYWORD_ONLY
    if name == ARGUMENT:
        info: Any = typer.Argument(None, help=help_text(f"{_flags_named(doc.text)} Its own arguments follow (after --)."),
                                   show_default=doc.default, metavar="SCRIPT")
        return inspect.Parameter(name, kind, default=info, annotation=str | None)
    flag = "--" + name.replace("_", "-")
    decls = DECLS.get(name) or ((f"{flag}/--no-{name.replace('_', '-')}",) if cli_type is bool else (flag,))
    from autobalance.tuner import CHOICES

    metavar = "|".join(CHOICES[name]) if name in CHOICES else FIELD_METAVARS.get(name, METAVARS.get(annotation))
    info = typer.Option(
        None if described else doc.value, *decls, help=help_text(_flags_named(doc.text)),
        show_default=doc.default if described else True, metavar=metavar,
    )
    return inspect.Parameter(name, kind, default=info, annotation=cli_type | None if described else cli_type)


def with_settings_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Give ``fn(ctx, config, **values)`` the signature typer reads: the context, SCRIPT, one option
    per settings field (:data:`EXTRA` comes from ``ctx.args``) and ``--config``."""
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    for name, annotation in _settings_fields():
        if name != EXTRA:
            params.append(_parameter(name, annotation))
    params.append(inspect.Parameter(
        "config", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
        default=typer.Option(None, "--config", metavar="TOML", show_default="none",
                             help="Study TOML with these settings (keys: the flag names, dashes or underscores); "
                                  "flags given here win over it, it wins over the defaults."),
    ))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {}
    return fn


def settings_from_command_line(ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line (a default is not given: the study TOML may set it),
    converted to the fields' types."""
    annotations = dict(_settings_fields())
    given: dict[str, Any] = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if value is None or source is None or source.name != "COMMANDLINE":
            continue
        annotation = annotations[name]
        if annotation == "list[float] | None":
            value = parse_floats(flag_of(name), value)
        elif annotation == "list[str] | None":
            value = parse_list(flag_of(name), value)
        elif annotation == "list[str]":
            value = list(value)
        given[name] = value
    extra = list(ctx.args)
    if str(given.get(ARGUMENT, "")).startswith("-"):  # `tune --config s.toml -- --lr 1`: no SCRIPT, its arguments
        extra.insert(0, given.pop(ARGUMENT))
    if extra:
        given[EXTRA] = extra
    return given

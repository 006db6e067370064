# Copyright 2026 The path-hf authors. Apache-2.0.
"""Options as dataclasses: the one mechanism that turns a dataclass into command-line flags (`path-hf convert`,
`path-hf eval`, `recipes/train.py`) and reads a mapping into one (the recipes' YAML sections), checking every value.

A field is one option. Its type annotation says what it holds; its metadata says the rest:

- `help`: the documentation of the flag or key;
- `choices`: the values it accepts;
- `parse`: a function from the text of a flag to the value (`"0-11,20"` -> `(0, ..., 11, 20)`), whose ValueError
  message the user sees;
- `flag`: the flag's name when it is not `--field-name` (`--from` for `source`); `positional=True` for an argument
  without a flag;
- `metavar`, `nargs` (`"+"`: one or more values after the flag), `repeat=True` (the flag is given once per value,
  `--model a --model b`), `negate` (a flag that sets a bool that defaults to True to False: `--no-progress`).

Why not transformers' `HfArgumentParser`: it takes the type of a flag from the annotation alone, so values written in
a notation (`--layers 0-11,20`, `--max-shard-size 5GB`, `--model LABEL=PATH@yarn`) have nowhere to be parsed; it makes
every list `nargs="+"`, where `--model` repeats; it names each flag after its field (`--source` beside `--from`); and
`parse_dict` / `parse_yaml_file` check neither types nor nested sections, which the recipes' YAML files need.
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, fields, is_dataclass

# The dtypes a model is loaded or converted in, by name (--dtype, model.dtype).
DTYPES = ("float32", "bfloat16", "float16")


def flag(option: Field) -> str:
    """The flag of a field: `--field-name`, or its `flag` metadata."""
    return option.metadata.get("flag", "--" + option.name.replace("_", "-"))


def default_of(option: Field):
    """A field's default value (its factory called), or `MISSING` for a required field."""
    if option.default_factory is not MISSING:
        return option.default_factory()
    return option.default


def argument_type(parse: Callable[[str], typing.Any]) -> Callable[[str], typing.Any]:
    """`parse`, with its ValueError message shown by argparse (which otherwise prints only the function's name)."""

    def parse_argument(value: str):
        try:
            return parse(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parse_argument.__name__ = parse.__name__
    return parse_argument


def finite_float(text: str) -> float:
    """A float flag's value: a number, never NaN or infinite (a NaN option writes a NaN model without a word)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text}")
    return value


def _value_type(kind):
    """`X` of `X | None`, and the item type of `list[X]`."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if typing.get_origin(kind) is list:
        (kind,) = typing.get_args(kind)
    return kind


def add_arguments(parser: argparse.ArgumentParser, options_class: type) -> None:
    """One argument per field of the dataclass `options_class`, typed and documented from the field."""
    hints = typing.get_type_hints(options_class)
    for option in fields(options_class):
        if not option.init:
            continue
        meta = option.metadata
        default = default_of(option)
        kwargs: dict = {"help": meta.get("help")}
        if hints[option.name] is bool:
            kwargs["action"] = "store_false" if meta.get("negate") else "store_true"
        else:
            value_type = _value_type(hints[option.name])
            kwargs["type"] = argument_type(meta.get("parse", finite_float if value_type is float else value_type))
            if default is MISSING and not meta.get("positional"):
                kwargs["required"] = True
            elif default is not MISSING:
                kwargs["default"] = None if meta.get("repeat") else default
            if meta.get("repeat"):
                kwargs["action"] = "append"
            for key in ("choices", "metavar", "nargs"):
                if key in meta:
                    kwargs[key] = meta[key]
        if meta.get("positional"):
            parser.add_argument(option.name, **kwargs)
        else:
            parser.add_argument(meta.get("negate") or flag(option), dest=option.name, **kwargs)


def from_arguments(args: argparse.Namespace, options_class: type):
    """The `options_class` instance holding the parsed arguments (`add_arguments`); a repeatable flag that was not
    given takes its field's default."""
    values = {}
    for option in fields(options_class):
        if option.init:
            value = getattr(args, option.name)
            values[option.name] = default_of(option) if value is None and option.metadata.get("repeat") else value
    return options_class(**values)


def check_choices(options, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the flag when a field of the dataclass instance `options` holds a value outside its
    `choices`, as a direct construction in Python (no argparse) can."""
    for option in fields(options):
        choices = option.metadata.get("choices")
        value = getattr(options, option.name)
        if choices and value is not None and value not in choices:
            raise error(f"{flag(option)} must be one of {', '.join(map(str, choices))}; got {value!r}.")


# Mappings (YAML sections, `key=value` overrides) -> dataclasses


def _convert(value, kind, name: str, error: type[Exception]):
    """`value` checked against the annotation `kind`: ints become floats where floats are expected, numbers in
    scientific notation (`1e6`, which YAML 1.1 reads as a string) become numbers, whole floats become ints."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, name, error)
            except error as failure:
                errors.append(str(failure))
        raise error(errors[0])
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise error(f"{name} must be a list, got {value!r}")
        return [_convert(v, item, f"{name}.{i}", error) for i, v in enumerate(value)]
    if is_dataclass(kind):
        return from_mapping(kind, value, name, error)
    if kind is dict:
        if not isinstance(value, dict):
            raise error(f"{name} must be a mapping, got {value!r}")
        return value
    if kind in (int, float) and isinstance(value, str):
        try:
            value = float(value)  # YAML 1.1 reads 1e6 (no dot) as a string
        except ValueError:
            raise error(f"{name} must be {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)  # finite or not: the range checks of each option say what it allows
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e6 tokens
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise error(f"{name} must be {kind.__name__}, got {value!r}")
    return value


def from_mapping(options_class: type, data, prefix: str = "", error: type[Exception] = ValueError):
    """`options_class(**data)`, every key checked: unknown keys, missing required keys, types (nested dataclasses and
    lists of them included) and `choices` raise `error` naming the field (`prefix.key`)."""
    if not isinstance(data, dict):
        raise error(f"{prefix or 'the config file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(options_class)
    known = {option.name: option for option in fields(options_class) if option.init}
    for key in data:
        if key not in known:
            where = f" of {prefix}" if prefix else ""
            raise error(f"unknown key {_join(prefix, key)} (known keys{where}: {', '.join(known)})")
    values = {}
    for name, option in known.items():
        full_name = _join(prefix, name)
        if name not in data:
            if default_of(option) is MISSING:
                raise error(f"{full_name} is required: {option.metadata.get('help', '')}")
            continue
        values[name] = _convert(data[name], hints[name], full_name, error)
        choices = option.metadata.get("choices")
        if choices and values[name] not in choices:
            raise error(f"{full_name} must be one of {', '.join(map(str, choices))}; got {values[name]!r}")
    return options_class(**values)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def describe_fields(options_class: type, prefix: str) -> list[str]:
    """`  prefix.key (default: ...): help` for every field, the key listing of a `--help`."""
    lines = []
    for option in fields(options_class):
        default = default_of(option)
        shown = " (required)" if default is MISSING else f" (default: {default})"
        lines.append(f"  {prefix}.{option.name}{shown}: {option.metadata['help']}")
    return lines


__all__ = [
    "DTYPES",
    "add_arguments",
    "argument_type",
    "check_choices",
    "default_of",
    "describe_fields",
    "flag",
    "from_arguments",
    "from_mapping",
]

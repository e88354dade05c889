"""argparse flags generated from the fields of any config dataclass (the idea of vLLM's
vllm/engine/arg_utils.py), so a flag's name, type, choices, default and help live beside the field.

A field becomes one flag:

- name: `--field-name` (underscores become dashes); metadata `"flag"` overrides it, e.g.
  `ServerConfig.shutdown_grace_s` is `--shutdown-grace-seconds`.
- type: from the annotation, `X | None` unwrapped: `int`, `float`, `str`; `Literal[...]` gives
  argparse `choices=` (listed in `--help`, anything else rejected with the list); `bool` gives the
  pair `--flag / --no-flag` (argparse's BooleanOptionalAction, vLLM's spelling).
- default: the field's own. A field without one (a required constructor argument) may take a CLI
  default from the caller's overrides; one that has one may not, so no default is written twice.
- help: metadata `"help"`; the formatter appends the default.

Callers that cannot put metadata on a field (a dataclass another module owns) pass the same keys in
`overrides`. Stdlib only: `kvflow bench` and `kvflow doctor` build their flags here without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Collection, Iterable, Mapping
from types import NoneType, UnionType
from typing import Any, Literal

# The values the deprecated `--flag VALUE` spelling of boolean flags accepted (every boolean engine
# flag took one before the `--flag / --no-flag` pairs); `FlagParser` still maps them onto the pair.
DEPRECATED_BOOL_WORDS: Mapping[str, bool] = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
FieldOverrides = Mapping[str, Mapping[str, Any]]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to each flag's help, except where X is None: "(default: None)" says
    nothing, so such flags say in their help what leaving them unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser that shows every flag's default in `--help` and, for one release, still
    accepts `--flag true|false` for a boolean flag, rewritten to `--flag` / `--no-flag` with a warning
    on stderr. Subparsers made by `add_subparsers` are FlagParsers too (argparse uses the parent's
    class), and each rewrites only its own flags: a subcommand receives its arguments through its
    own `parse_known_args`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # Any: argparse's overloads return the namespace type given
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._rewrite_deprecated_bools(argv), namespace)

    def _rewrite_deprecated_bools(self, argv: list[str]) -> list[str]:
        """`--flag false` / `--flag=false` -> `--no-flag`; `--flag true` -> `--flag`. Only when the
        value is one of DEPRECATED_BOOL_WORDS: after a bare `--flag` the next argument may be a
        positional (`kvflow serve --enable-prefix-caching MODEL`), which must stay one."""
        positive = {
            action.option_strings[0]
            for action in self._actions
            if isinstance(action, argparse.BooleanOptionalAction)
        }
        out: list[str] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg == "--":  # everything after it is positional
                return out + argv[i:]
            name, eq, value = arg.partition("=")
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            word = DEPRECATED_BOOL_WORDS.get(value.lower()) if name in positive else None
            if word is None:
                out.append(arg)
                i += 1
                continue
            flag = name if word else "--no-" + name.removeprefix("--")
            typed = arg if eq else f"{arg} {value}"
            print(f"{self.prog.split()[0]}: warning: '{typed}' is deprecated; use {flag}", file=sys.stderr)
            out.append(flag)
            i += 1 if eq else 2
        return out


def cli_fields(
    cls: type, include: Collection[str] | None = None, exclude: Collection[str] = ()
) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass `cls` that are flags: `include` (all when None) less `exclude`."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = (set(include or ()) | set(exclude)) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    return [f for f in fields if (include is None or f.name in include) and f.name not in exclude]


def add_dataclass_args(
    container: argparse._ActionsContainer,
    cls: type,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    overrides: FieldOverrides | None = None,
) -> None:
    """Add one flag per field of dataclass `cls` to a parser or argument group (`dest` = field name).

    `overrides[field]` holds metadata keys for fields whose class carries none: "flag", "help", and
    "default" for a field without a default of its own."""
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls, include, exclude):
        meta = {**f.metadata, **(overrides or {}).get(f.name, {})}
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kwargs = _flag_kwargs(cls, f, hints[f.name], meta)
        if "type" in kwargs and "choices" not in kwargs:  # as argparse would name it from the flag
            kwargs["metavar"] = flag.removeprefix("--").replace("-", "_").upper()
        container.add_argument(flag, **kwargs)


def dataclass_kwargs(
    args: argparse.Namespace, cls: type, include: Collection[str] | None = None, exclude: Collection[str] = ()
) -> dict[str, Any]:
    """The parsed values of the flags `add_dataclass_args` added for `cls`, by field name."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls, include, exclude)}


def literal_choices(hint: Any) -> tuple[Any, ...]:
    """`Literal["a", "b"]` (nested Literals flattened) -> ("a", "b")."""
    if typing.get_origin(hint) is not Literal:
        raise TypeError(f"expected a Literal type, got {hint!r}")
    return typing.get_args(hint)


def _flag_kwargs(cls: type, f: dataclasses.Field[Any], hint: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    where = f"{cls.__name__}.{f.name}"
    # argparse %-formats help strings (for %(default)s): a literal % must be doubled.
    kwargs: dict[str, Any] = {"dest": f.name, "help": str(meta.get("help", "")).replace("%", "%%")}
    own_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    if own_default and "default" in meta:
        raise ValueError(f"{where} has a default: the flag takes it, not a second one")
    if f.default is not dataclasses.MISSING:
        kwargs["default"] = f.default
    elif f.default_factory is not dataclasses.MISSING:
        kwargs["default"] = f.default_factory()
    elif "default" in meta:
        kwargs["default"] = meta["default"]
    else:
        kwargs["required"] = True
    base = _unwrap_optional(hint)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is Literal:
        choices = literal_choices(base)
        kinds = {type(c) for c in choices}
        if len(kinds) != 1:
            raise TypeError(f"{where}: a Literal flag needs choices of one type, got {choices}")
        kwargs["type"], kwargs["choices"] = kinds.pop(), choices
    elif base in (int, float, str):
        kwargs["type"] = base
    else:
        raise TypeError(f"{where}: no flag for type {hint!r}; exclude the field and write its flag by hand")
    return kwargs


def _unwrap_optional(hint: Any) -> Any:
    """`int | None` (or Optional[int]) -> int; anything else unchanged."""
    if typing.get_origin(hint) in (typing.Union, UnionType):
        args = [a for a in typing.get_args(hint) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return hint

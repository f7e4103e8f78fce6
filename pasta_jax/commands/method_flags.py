"""The CLI's --method and method option flags, built from the method registry: every option a method declares (a
field of its dataclass, with a help line) is a flag, shared by the methods that have an option of that name."""

from __future__ import annotations

import argparse
import dataclasses

from pasta_jax.errors import PastaError
from pasta_jax.methods import registry
from pasta_jax.methods.base import Method

PREFIX = "option_"  # the flags' argparse destinations, apart from the command's own


def _cli_options() -> dict[str, list[tuple[type[Method], dataclasses.Field]]]:
  """Option name -> the (method, field) pairs that declare it, for the options with a flag."""
  options: dict[str, list] = {}
  for cls in registry.METHODS.values():
    for field in cls.options():
      if field.metadata.get("cli", True) and "help" in field.metadata:
        options.setdefault(field.name, []).append((cls, field))
  return options


def _flag_type(field: dataclasses.Field):
  if "parse" in field.metadata:
    return field.metadata["parse"]
  return type(field.default) if isinstance(field.default, (int, float)) else str


def add_method_flags(parser: argparse.ArgumentParser, choices: tuple[str, ...], default_help: str) -> None:
  """--method NAME (one of `choices`) and a flag per method option (each says which methods take it)."""
  lines = "; ".join(f"{name}: {registry.METHODS[name].summary}" for name in choices)
  parser.add_argument("--method", choices=choices, default=None, help=f"{default_help}. {lines}")
  add_option_flags(parser)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
  """A flag per method option (each says which methods take it)."""
  for name, owners in _cli_options().items():
    cls, field = owners[0]
    which = ", ".join(c.name for c, _ in owners)
    boolean = isinstance(field.default, bool)
    kind = {"action": argparse.BooleanOptionalAction} if boolean else {"type": _flag_type(field),
                                                                       "metavar": name.upper()}
    parser.add_argument(f"--{name.replace('_', '-')}", dest=PREFIX + name, default=None, **kind,
                        help=f"--method {which}: {field.metadata['help']}")


def given_options(args: argparse.Namespace) -> dict:
  """The method option flags given on the command line, by option name."""
  return {k[len(PREFIX):]: v for k, v in vars(args).items() if k.startswith(PREFIX) and v is not None}


def method_from_flags(name: str, args: argparse.Namespace) -> Method:
  """The method `name` with the option flags given; a flag it does not take is an error that names its methods."""
  cls = registry.METHODS[name]
  own = {f.name for f in cls.options()}
  given = given_options(args)
  for option in given:
    if option not in own:
      which = ", ".join(c.name for c, _ in _cli_options()[option])
      raise PastaError(f"--{option.replace('_', '-')} is an option of --method {which}, not of {name}")
  return cls(**given)


def apply_to_all(methods: tuple[str, ...], args: argparse.Namespace) -> dict[str, Method]:
  """Each method of `methods` with the option flags that it takes (a server's flags set every method's option
  of that name); a flag that none of them takes is an error."""
  given = given_options(args)
  unused = set(given)
  out = {}
  for name in methods:
    cls = registry.METHODS[name]
    own = {f.name for f in cls.options()} & set(given)
    unused -= own
    out[name] = cls(**{k: given[k] for k in own})
  if unused:
    raise PastaError(f"--{sorted(unused)[0].replace('_', '-')} is an option of no method served here")
  return out

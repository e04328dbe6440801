"""What a setting is: its variable, its type and bounds, how it is read and how it is checked.

A section is a frozen dataclass that derives from ``Section`` and names its part of the
environment (``section="gateway"``: ``LLAMAMESH_GATEWAY_<FIELD>``). A field's annotation is its
type (bool, int, float, str or a ``Literal`` of strings, any of them ``| None``); ``setting()``
adds its bounds; the string under it describes it (docs/configuration.md is rendered from them).
Every value is checked when a section is built, from the environment or in code alike.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
S = TypeVar("S", bound="Section")

PREFIX = "LLAMAMESH_"


def env_name(section: str, name: str) -> str:
    """The variable of field ``name`` of ``section``: ``LLAMAMESH_<SECTION>_<NAME>``."""
    return f"{PREFIX}{section}_{name}".upper()


@dataclass(frozen=True)
class Range:
    """Bounds of a number: ``low`` and ``high`` are inclusive (None: unbounded); ``above`` is an
    exclusive lower bound, for values that must be more than it (a period of 0 would spin)."""

    low: float | None = None
    high: float | None = None
    above: float | None = None

    def __contains__(self, value: float) -> bool:
        # Written so that NaN is in no range (every comparison with it is false), nor infinity.
        return (
            math.isfinite(value)
            and (self.low is None or value >= self.low)
            and (self.high is None or value <= self.high)
            and (self.above is None or value > self.above)
        )

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"from {_number(self.low)} to {_number(self.high)}"
        parts = []
        if self.low is not None:
            parts.append(f"{_number(self.low)} or more")
        if self.above is not None:
            parts.append(f"more than {_number(self.above)}")
        if self.high is not None:
            parts.append(f"at most {_number(self.high)}")
        return " and ".join(parts)


PORT = Range(0, 65535)
# No number setting is larger (2**53): Redis takes a TTL in seconds up to about this, times 1000 in
# milliseconds; past it a time or a count is a typo, refused at start rather than failing every call.
LARGEST = 2**53
FRACTION = Range(0, 1)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default: T, bounds: Range | None = None, *, shown: str = "") -> T:
    """A field's default and, for a number, its ``bounds``; ``shown``: the default as the reference
    prints it when the value itself depends on the machine (a home folder)."""
    return dataclasses.field(default=default, metadata={"bounds": bounds, "shown": shown})


@dataclass(frozen=True)
class Spec:
    """One setting as the reader, the checker and the reference see it."""

    section: str
    name: str
    env: str
    # bool, int, float or str; ``choices``: the only strings allowed (a Literal), else ().
    kind: type
    choices: tuple[str, ...]
    optional: bool
    bounds: Range | None
    default: Any
    shown: str

    def expected(self) -> str:
        """What a value must be, in words: ``an integer, from 0 to 65535``."""
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            text = _KIND_WORDS[self.kind]
            if self.bounds is not None:
                text += f", {self.bounds}"
        return text + (" (or empty)" if self.optional else "")

    def parse(self, raw: str) -> Any:
        """The value of the variable's text; ValueError in one line naming the variable."""
        if self.optional and not raw.strip():
            return None
        try:
            value = _READERS[self.kind](raw)
        except ValueError:
            raise ValueError(f"{self.env}={raw!r}: expected {self.expected()}") from None
        self.check(value, raw)
        return value

    def check(self, value: Any, raw: str | None = None) -> None:
        """ValueError in one line naming the variable and the value (``raw``: as the variable wrote it)
        when ``value`` is of the wrong type or out of bounds."""
        if value is None and self.optional:
            return
        fits = _is_kind(value, self.kind) and (not self.choices or value in self.choices)
        shown = repr(value) if raw is None else raw if self.kind in (int, float) else repr(raw)
        if not fits or (self.bounds is not None and value not in self.bounds):
            raise ValueError(f"{self.env}={shown}: expected {self.expected()}")
        if self.kind in (int, float) and abs(value) > LARGEST:
            raise ValueError(f"{self.env}={shown}: expected {self.expected()}, at most {LARGEST}")

    def text(self, value: Any) -> str:
        """``value`` as the variable's text (``parse`` reads it back; a bool as the docs write it)."""
        if isinstance(value, bool):
            return "true" if value else "false"
        return "" if value is None else str(value)


def _read_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _read_number(kind: type[int] | type[float]) -> Any:
    """int or float, but not the ``1_000`` form Python's own readers also take."""

    def read(raw: str) -> int | float:
        if "_" in raw:
            raise ValueError(raw)
        return kind(raw)

    return read


_READERS: Mapping[type, Any] = {bool: _read_bool, int: _read_number(int), float: _read_number(float), str: str}
_KIND_WORDS: Mapping[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, never to a setting
        return kind is bool
    if kind is float:  # an int where a float goes keeps its value: 10 seconds are 10.0
        return isinstance(value, int | float)
    return isinstance(value, kind)


class Section:
    """Base of every settings section: ``__post_init__`` checks each field against its spec.

    A subclass that checks more (one field against another) extends ``__post_init__``."""

    section: ClassVar[str] = ""

    def __init_subclass__(cls, *, section: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = section

    def __post_init__(self) -> None:
        for spec in specs(type(self)):
            spec.check(getattr(self, spec.name))


_SPECS: dict[type, tuple[Spec, ...]] = {}


def specs(cls: type[Section]) -> tuple[Spec, ...]:
    """The spec of each field of section ``cls``, in order (worked out once per class)."""
    if cls not in _SPECS:
        _SPECS[cls] = _specs_of(cls)
    return _SPECS[cls]


def _specs_of(cls: type[Section]) -> tuple[Spec, ...]:
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # a Section subclass is a dataclass
        kind, choices, optional = _kind_of(hints[f.name], cls, f.name)
        out.append(
            Spec(
                section=cls.section,
                name=f.name,
                env=env_name(cls.section, f.name),
                kind=kind,
                choices=choices,
                optional=optional,
                bounds=f.metadata.get("bounds"),
                default=f.default,
                shown=f.metadata.get("shown", ""),
            )
        )
    return tuple(out)


def _kind_of(hint: Any, cls: type, name: str) -> tuple[type, tuple[str, ...], bool]:
    """(kind, choices, optional) of a field's annotation; TypeError for a type no variable can hold."""
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = tuple(a for a in get_args(hint) if a is not type(None))
        optional = len(args) < len(get_args(hint))
        hint = args[0] if len(args) == 1 else hint
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if all(isinstance(c, str) for c in choices):
            return str, choices, optional
    elif hint in _READERS:
        return hint, (), optional
    raise TypeError(f"{cls.__name__}.{name}: a setting is a bool, int, float, str or Literal of str (or None)")


def section_from_env(cls: type[S], env: Mapping[str, str]) -> S:
    """Section ``cls`` with each field whose variable is in ``env`` read from it, the others at
    their defaults; ValueError naming the first variable that is wrong."""
    values = {spec.name: spec.parse(env[spec.env]) for spec in specs(cls) if spec.env in env}
    return cls(**values)

"""The configuration reference, docs/configuration.md, rendered from the settings themselves: each
section's variables with their type, default, bounds and description (the string under each field).
tests/unit/test_configuration_doc.py fails when the page and the code differ. Regenerate it with

    .venv/bin/python -m llamamesh.settings.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import inspect
import itertools
import sys
import textwrap

from llamamesh.settings.environment import sections
from llamamesh.settings.schema import Section, Spec, specs

COMMAND = ".venv/bin/python -m llamamesh.settings.reference > docs/configuration.md"

INTRO = f"""\
# Configuration

<!-- Rendered from llamamesh/settings/ by `{COMMAND}`: edit the settings, not this page. -->

Every setting is an environment variable `LLAMAMESH_<SECTION>_<FIELD>`, read once when a process
starts (`llamamesh serve`'s flags override a few of them). A value of the wrong type or out of its
range, or a `LLAMAMESH_*` variable that is no setting (a typo), stops the process at once with one
line naming the variable. Booleans are `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`
(or empty); a setting whose type says "or empty" takes an empty value as "not set". No number is
larger than 2^53 (9007199254740992).
"""


def descriptions(cls: type[Section]) -> dict[str, str]:
    """Each field of section ``cls`` and the string right under it in the source, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            out[stmt.target.id] = " ".join(after.value.value.split())
    return out


def render() -> str:
    """The whole page."""
    parts = [INTRO]
    for name, cls in sections().items():
        parts.append(f"\n## {name}\n")
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):  # not dataclass's own signature
            parts.append("\n" + _cell_text(cls.__doc__) + "\n")
        parts.append("\n| Variable | Type | Default | Range | Description |\n|---|---|---|---|---|\n")
        docs = descriptions(cls)
        for spec in specs(cls):
            cells = (f"`{spec.env}`", _type(spec), _default(spec), str(spec.bounds or ""), docs.get(spec.name, ""))
            parts.append("| " + " | ".join(_cell_text(c) for c in cells) + " |\n")
    return "".join(parts)


def _type(spec: Spec) -> str:
    text = "one of " + ", ".join(f"`{c}`" for c in spec.choices) if spec.choices else spec.kind.__name__
    return text + " or empty" if spec.optional else text


def _default(spec: Spec) -> str:
    value = spec.shown or spec.text(spec.default)
    if isinstance(spec.default, bool):
        value = value.lower()
    return f"`{value}`" if value else "(empty)"


def _cell_text(text: str) -> str:
    """One line of markdown a table cell can hold: ``code`` as `code`, pipes escaped, and outside code
    no ``<`` that markdown would take for a tag."""
    pieces = " ".join(text.split()).replace("``", "`").replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(pieces))


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()

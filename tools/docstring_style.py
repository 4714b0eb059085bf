"""A griffe extension for the docs build: renders the docstrings' conventions as mkdocstrings needs.

The docstrings follow torchtune's style: they name other objects with
Sphinx roles (``:class:`OffloadOptions```), which ``help()`` shows as they are and mkdocstrings
would print literally, and they open doctests with ``Example:``, which griffe's Google parser
reads as a free-text admonition (``>>>`` would become nested quotes). mkdocs.yml loads this file;
it turns each role into a cross-reference to the object it names, resolved in the docstring's own
scope, or into plain code where nothing on the site documents the target (builtins, torch), and
reads ``Example:`` as griffe's ``Examples:``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):`(~?)([\w.]+)`")
EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:  # documented where it is defined
            yield from _objects(member)  # type: ignore[arg-type]


def _target(scope: griffe.Object, name: str) -> str:
    head, _, rest = name.partition(".")
    try:
        resolved = scope.resolve(head)
    except griffe.NameResolutionError:
        return name
    return f"{resolved}.{rest}" if rest else resolved


class DocstringStyle(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is None:
                continue

            def link(match: re.Match[str], scope: griffe.Object = obj) -> str:
                short, name = match.group(1), match.group(2)
                text = name.rsplit(".", 1)[-1] if short else name
                # ``optional``: a target the site does not document renders as plain code.
                target = _target(scope, name)
                return f'<autoref identifier="{target}" optional><code>{text}</code></autoref>'

            value = ROLE.sub(link, obj.docstring.value)
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", value)

"""Griffe extension for the API reference: the bases a class shows are public ones.

A class such as ``AdamW(_Engine)`` would show ``Bases: _Engine``, a name the user cannot
import and that has no page. This records, for every class of the package, its bases with each
private one (a name starting with ``_``, resolved within the loaded package) replaced by that
class's own bases, recursively: ``AdamW`` shows ``torch.optim.Optimizer``, a schedule derived from
private helpers only shows none. The list goes to ``cls.extra["halfadam"]["public_bases"]``, which
docs/_ext/templates/python/material/class.html.jinja renders in place of ``cls.bases``;
``cls.bases`` itself stays as it is, so inherited members are still found through the private base.
"""

from __future__ import annotations

import griffe


def _private(expression) -> bool:
    path = expression if isinstance(expression, str) else expression.canonical_path
    return path.rsplit(".", 1)[-1].startswith("_")


def public_bases(cls: griffe.Class, seen: frozenset = frozenset()) -> list:
    """``cls``'s bases (expressions), each private base replaced by its own public bases."""
    out = []
    for expression in cls.bases:
        if not _private(expression):
            if all(str(expression) != str(e) for e in out):
                out.append(expression)
            continue
        path = expression if isinstance(expression, str) else expression.canonical_path
        try:
            base = cls.modules_collection.get_member(path)
            base = base.final_target if base.is_alias else base
        except (griffe.AliasResolutionError, griffe.CyclicAliasError, KeyError):
            out.append(expression)  # not resolvable: shown as it is (the test of the built site fails on it)
            continue
        if base.is_class and base.path not in seen:
            out += [e for e in public_bases(base, seen | {base.path}) if all(str(e) != str(o) for o in out)]
    return out


class PublicBases(griffe.Extension):
    """Records each class's public bases (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen = set()
        stack = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.is_class:
                obj.extra["halfadam"]["public_bases"] = public_bases(obj)
            stack.extend(obj.members.values())

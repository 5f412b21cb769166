"""Startup check for code that replaces or copies another library's internals.

``narwhal.frontdoor.connection``, ``narwhal.frontdoor.direct`` and ``narwhal.frontdoor.listener``
each list, in ``SHAPES``, the functions of hypercorn, h11 and trio whose exact source they
were written against (a digest of it). The versions are pinned in pyproject.toml; this
check turns a mismatch that slipped past the pins (a patch release, a vendored copy) into a
refusal to start with the name of what changed, never a silent fallback.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap


class ShapeMismatch(RuntimeError):
    """A library's internals are not the ones a narwhal fix was written against."""


def digest(obj: object) -> str:
    source = textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def resolve(path: str) -> object:
    """``package.module:Class.attr`` -> the object."""
    module, _, attrs = path.partition(":")
    obj: object = importlib.import_module(module)
    for name in attrs.split("."):
        obj = inspect.getattr_static(obj, name) if isinstance(obj, type) else getattr(obj, name)
        obj = getattr(obj, "__func__", obj)  # staticmethod / classmethod
        obj = getattr(obj, "__narwhal_original__", obj)  # replaced already: the original
    return obj


def mismatches(known: dict[str, str]) -> list[str]:
    problems = []
    for path, expected in known.items():
        try:
            actual = digest(resolve(path))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            problems.append(f"{path}: cannot be read ({exc})")
            continue
        if actual != expected:
            problems.append(f"{path}: source digest {actual}, written against {expected}")
    return problems


def verify(known: dict[str, str]) -> None:
    problems = mismatches(known)
    if problems:
        raise ShapeMismatch(
            "the installed hypercorn/h11/trio are not the versions narwhal's server fixes "
            "were written against (pyproject.toml pins them): " + "; ".join(problems)
        )

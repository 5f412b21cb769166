"""Startup check for code that runs against another library's internals.

``narwhal.frontdoor.seams`` lists the functions and classes of hypercorn and h11 whose exact
source the front door was written against (``DIGESTS``, a digest of each) and the private
attributes it reads that no digest covers (``PRESENT``, a check of each). The versions are
pinned in pyproject.toml; this check turns a mismatch that slipped past the pins (a patch
release, a vendored copy) into a refusal to start with the name of what changed, never a
silent fallback.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Callable, Mapping


class InternalsMismatch(RuntimeError):
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
    return obj


def mismatches(
    known: Mapping[str, str], present: Mapping[str, Callable[[], bool]] | None = None
) -> list[str]:
    """What differs: each digest in ``known`` against the installed source, and each
    check in ``present`` (a private attribute that no digest covers) that fails."""
    problems = []
    for name, check in (present or {}).items():
        if not check():
            problems.append(f"{name}: not present")
    for path, expected in known.items():
        try:
            actual = digest(resolve(path))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            problems.append(f"{path}: cannot be read ({exc})")
            continue
        if actual != expected:
            problems.append(f"{path}: source digest {actual}, written against {expected}")
    return problems


def verify(
    known: Mapping[str, str], present: Mapping[str, Callable[[], bool]] | None = None
) -> None:
    problems = mismatches(known, present)
    if problems:
        raise InternalsMismatch(
            "the installed hypercorn/h11/trio are not the versions narwhal's server fixes "
            "were written against (pyproject.toml pins them): " + "; ".join(problems)
        )

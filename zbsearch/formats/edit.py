"""Edits of file-format models that go through validation.

``model_copy(update=...)`` sets fields without validating them, so an edited profile or
schedule could hold what no file may hold. ``updated`` builds the model again from its
fields and the changes, so every validator runs.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

__all__ = ["updated"]

M = TypeVar("M", bound=BaseModel)


def updated(model: M, **changes: Any) -> M:
    """A validated copy of ``model`` with ``changes`` applied (a field's new value may be a model)."""
    fields = {name: getattr(model, name) for name in type(model).model_fields}
    return type(model).model_validate({**fields, **(model.model_extra or {}), **changes})

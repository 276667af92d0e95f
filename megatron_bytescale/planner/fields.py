"""Errors that name the planner's fields, for each caller to spell in its own terms.

The planner is a library: its errors name the ``PlannerConfig`` (or ``CostModel``) field to
change. Their messages keep the fields as ``{field}`` placeholders: ``str()`` gives the field
names themselves, and a caller with flags of its own (``bytescale plan``, the simulator, the
Megatron glue) spells them its way at its boundary (``renamed({field: flag})``)."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import BytescaleError, ConfigError, PlanError


class FieldMessage(BytescaleError):
    """An error whose message names fields as ``{field}`` placeholders."""

    plain: type[BytescaleError] = BytescaleError  # the error it is without the placeholders

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.named())

    def named(self, names: Mapping[str, str] | None = None) -> str:
        """The message with each field spelled as ``names`` says (else by its own name)."""
        return self.template.format_map(_Names(names or {}))

    def renamed(self, names: Mapping[str, str]) -> BytescaleError:
        """The same error, its fields spelled as ``names`` says."""
        return self.plain(self.named(names))


class FieldError(FieldMessage, ConfigError):
    """A ``ConfigError`` naming fields."""

    plain = ConfigError


class FieldPlanError(FieldMessage, PlanError):
    """A ``PlanError`` naming fields."""

    plain = PlanError


class _Names(dict):
    def __missing__(self, field: str) -> str:
        return field


def literal(value) -> str:
    """``value`` as text inside a ``FieldMessage`` template (its braces kept as they are)."""
    return str(value).replace("{", "{{").replace("}", "}}")

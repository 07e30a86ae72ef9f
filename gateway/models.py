"""The served models: one engine each, found by the `model` a request names (its served name or an alias)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from security.principal import Principal


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: Any  # engine.AsyncEngine, or a test double with the same surface
    aliases: list[str] = field(default_factory=list)
    tool_call_parser: str = "auto"  # the model's tool-call format (engine.tool_call_parser; gateway.tools.select)

    @property
    def names(self) -> list[str]:
        """Every name a token's `models` claim may list to be allowed this model."""
        return [self.name, *self.aliases]


class ModelRegistry:
    """Served models in configuration order (the first is the default for /admin/profile) and their aliases."""

    def __init__(self, models: list[ServedModel], aliases: dict[str, str] | None = None) -> None:
        self.models = {m.name: m for m in models}
        if not models or len(self.models) != len(models):
            raise ValueError("a model registry needs at least one model, each with its own name")
        self.aliases = dict(aliases or {})
        for alias, target in self.aliases.items():
            if alias in self.models or target not in self.models:
                raise ValueError(f"alias {alias!r} must be a new name for a served model; {target!r} is not served")
            self.models[target].aliases.append(alias)

    @classmethod
    def single(cls, engine: Any) -> ModelRegistry:
        return cls([ServedModel(engine.model_name, engine)])

    def resolve(self, name: str) -> ServedModel | None:
        return self.models.get(self.aliases.get(name, name))

    def allowed(self, principal: Principal, model: ServedModel) -> bool:
        return principal.may_use_any(model.names)

    @property
    def first(self) -> ServedModel:
        return next(iter(self.models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models.values())

    @property
    def ready(self) -> bool:
        return all(m.engine.ready for m in self)

    @property
    def healthy(self) -> bool:
        return all(m.engine.healthy for m in self)

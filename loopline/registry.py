"""Components chosen by name in a config (an advantage estimator, a loss aggregation, ...), as verl registers its
policy losses and advantage estimators.

A registry's names are known without importing the components' modules (they need torch; a run config is
checked before torch loads): the built-in names are declared where the config is, and each component's module
registers its implementation under its name. A component defined anywhere else, a test module or a user's
plugin, registers itself the same way and is then a valid name in every config.

A component may bring its own settings (torchtitan's per-component config, verl's registered losses): a
`Settings` subclass registered with it, which validates the component's config section
(`engine: {kind: sglang, servers: [...]}`) once the section's name picks it; no shared model lists another
component's fields or branches on a name.
"""

from __future__ import annotations

import copyreg
import difflib
import functools
import re
from typing import Any, Callable, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from loopline.errors import LooplineError

T = TypeVar("T")


class UnregisteredComponent(LooplineError, KeyError):
    """A name no module of this process registered: valid where the config was read (its module imported
    there), missing here."""

    def __str__(self) -> str:  # (KeyError's would quote the message)
        return str(self.args[0])


class Settings(BaseModel):
    """The base of every config section: unknown keys refused (with a did-you-mean where the config is read),
    values frozen, no NaN or infinity (`lr: .inf` passed, then the ledger's JSON refused the run after 30 s of
    loading), and YAML's `true` is not a number (`steps: true` trained 1 step: pydantic would take it as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and field.annotation is not bool and "bool" not in str(field.annotation):
                    text = str(field.annotation)
                    what = "a number" if re.search(r"\b(int|float)\b", text) else "text" if re.search(r"\bstr\b", text) else "its settings (a mapping)"
                    raise ValueError(f"{name}: expected {what}, got {str(value).lower()}")
        return data


class Registry(Generic[T]):
    """Names -> components of one kind; `T` is the kind's Protocol (what a plugin writes)."""

    def __init__(self, what: str, setting: str, builtin: tuple[str, ...]) -> None:
        self.what, self.setting = what, setting
        self.names: list[str] = list(builtin)
        self._implementations: dict[str, T] = {}
        self._settings: dict[str, type[BaseModel]] = {}

    def register(self, name: str, settings: type[BaseModel] | None = None) -> Callable[[T], T]:
        """`@REGISTRY.register("name")` on the implementation: the name becomes valid in every config. `settings`:
        the component's own section model (a subclass of the section's base, `RegistrySection`)."""

        def add(implementation: T) -> T:
            self._implementations[name] = implementation
            if settings is not None:
                self._settings[name] = settings
            if name not in self.names:
                self.names.append(name)
            return implementation

        return add

    def declare_settings(self, name: str, settings: type[BaseModel]) -> None:
        """A built-in's settings, declared where the config is (its implementation registers in a module that
        loads its SDK only when one is used)."""
        self._settings[name] = settings

    def settings_models(self, base: type[BaseModel]) -> dict[str, type[BaseModel]]:
        """Each registered name's settings model (`base` for a component without settings of its own)."""
        return {name: self._settings.get(name, base) for name in self.names}

    def __getitem__(self, name: str) -> T:
        if name not in self._implementations:
            raise UnregisteredComponent(
                f"{self.setting}: no {self.what} {name!r} is registered in this process (the registered ones: "
                f"{', '.join(self._implementations)}); import the module that registers it here too"
            )
        return self._implementations[name]

    def check(self, name: str) -> None:
        """Refuse a name nobody declared or registered (a config's typo), naming the ones there are."""
        if name not in self.names:
            close = difflib.get_close_matches(str(name), self.names, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"unknown {self.what} {name!r}; {hint}one of: {', '.join(self.names)}")

    def check_implemented(self) -> None:
        """At the end of the module that implements the built-ins: every declared name has its implementation."""
        missing = [n for n in self.names if n not in self._implementations]
        if missing:  # (loopline's own defect: a built-in declared in a config module and never implemented)
            raise RuntimeError(f"{self.setting}: declared but not registered: {', '.join(missing)}")


class RegistryName:
    """A pydantic setting that names one of a registry's components, `kind: Annotated[str, RegistryName(ENGINES)]`:
    validated against the names registered when a config is read, shown as the JSON Schema's enum."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        def registered(name: str) -> str:
            self.registry.check(name)
            return name

        return core_schema.no_info_after_validator_function(registered, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        json_schema = handler(schema)
        json_schema["enum"] = list(self.registry.names)
        return json_schema


class RegistrySection:
    """A config section whose settings are its components' own, `engine: Annotated[EngineSettings,
    RegistrySection(ENGINES)]`: the section's `kind` (or `key`; validated by the base, as a `RegistryName`) picks the model
    registered with that component, which validates the whole section; its errors keep their paths
    (`engine.servers`). A section naming several components (`learner.loss`: its policy loss, correction and
    aggregation, `also`) is validated by their models combined. The JSON Schema offers one alternative per
    registered component (a section of several: every component's settings)."""

    def __init__(self, registry: Registry, key: str = "kind", **also: Registry) -> None:
        self.registry, self.key = registry, key
        self.registries = {key: registry, **also}

    def model(self, base: type[BaseModel], values: dict) -> type[BaseModel]:
        """The settings model of the components `values` names (validated names: see `validate`)."""
        own: list[type[BaseModel]] = []
        for key, registry in self.registries.items():
            name = values.get(key, base.model_fields[key].default)
            model = registry.settings_models(base)[name]
            if not issubclass(model, base):
                raise TypeError(f"{registry.setting} {name!r}: its settings {model.__name__} must subclass {base.__name__}")
            if model is not base and model not in own:
                own.append(model)
        return _combined(tuple(own)) if len(own) > 1 else own[0] if own else base

    def validate(self, base: type[BaseModel], value: object) -> BaseModel:
        """`value` (a mapping of settings) as its components' settings; `base`'s own errors first (a missing or
        unknown name, at `section.kind`)."""
        if isinstance(value, base):
            return value
        if not isinstance(value, dict) or any(key not in value and base.model_fields[key].is_required() for key in self.registries):
            return base.model_validate(value)
        base.model_validate({key: value[key] for key in self.registries if key in value})
        return self.model(base, value).model_validate(value)

    def stored_read(self, base: type[BaseModel], values: dict, shared: dict[str, Any]) -> dict:
        """A section stored before its components had settings of their own held every component's fields (`shared`:
        those that moved, at their defaults): the ones its components' settings lack are dropped while at their defaults."""
        try:
            own = self.model(base, values).model_fields
        except KeyError:  # (a name registered nowhere: the section's validation says so)
            return values
        return {k: v for k, v in values.items() if k in own or k not in shared or v != shared[k]}

    def __get_pydantic_core_schema__(self, source: type[BaseModel], handler: Any) -> Any:
        from pydantic_core import core_schema

        self._base = source
        return core_schema.no_info_plain_validator_function(lambda value: self.validate(source, value))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        if len(self.registries) > 1:  # (every combination would be too many alternatives: one model with every field)
            models = {m for registry in self.registries.values() for m in registry.settings_models(self._base).values()} - {self._base}
            return handler(_combined(tuple(sorted(models, key=lambda m: m.__name__))).__pydantic_core_schema__ if models else self._base.__pydantic_core_schema__)
        models = self.registry.settings_models(self._base)
        return {"anyOf": [{"allOf": [handler(model.__pydantic_core_schema__), {"properties": {self.key: {"const": name}}}]}
                          for name, model in models.items()]}


@functools.cache
def _combined(models: tuple[type[BaseModel], ...]) -> type[BaseModel]:
    """One model with the settings of several components (each a subclass of their section's base), made once per
    combination (a config compares equal only to one of the same model). Its instances pickle as their components
    and values (a learner rank or a Prefect task rebuilds the combination in its own process)."""
    if len(models) == 1:
        return models[0]
    combined = create_model("_".join(m.__name__ for m in models), __base__=models, __module__=__name__)
    copyreg.pickle(combined, lambda settings: (_rebuilt, (models, settings.model_dump())))
    return combined


def _rebuilt(models: tuple[type[BaseModel], ...], values: dict) -> BaseModel:
    return _combined(models).model_validate(values)

"""Validated, frozen configs.

One parameter has one name from a notebook's ``parameters`` cell through the YAML
sets in ``parameterized/``, the config dataclass and ``perflab run --param``.  A
config validates itself in ``__post_init__`` and refuses a bad value with a
:class:`ConfigError` naming the parameter, the value and what is allowed, before
any heavy work starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A parameter value that is not allowed.  The message names parameter, value and rule."""

    def __init__(self, param: str, value: Any, allowed: str):
        self.param, self.value, self.allowed = param, value, allowed
        super().__init__(f"parameter {param!r} = {value!r} is not allowed: expected {allowed}")

    def __reduce__(self):  # through a process pool: rebuilt from its three parts, not from the message
        return type(self), (self.param, self.value, self.allowed)


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
    """Where a suite's labs will run when that is not this machine (a SLURM partition's nodes): the
    CUDA devices one lab sees there, and words for messages."""

    gpus: int
    where: str  # "the jobs on partition gpu (GRES gpu:8)"


_TARGET: contextvars.ContextVar[DeviceTarget | None] = contextvars.ContextVar("perflab_device_target", default=None)


@contextlib.contextmanager
def validating_for(target: DeviceTarget | None):
    """While a suite is validated for ``target``, device-dependent checks (``device = 'cuda'``,
    ``world_sizes: [auto]``: ``lab_utils.core.device.cuda_devices``) ask it instead of this
    machine (None: this machine)."""
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)


def device_target() -> DeviceTarget | None:
    """The target being validated for (None: this machine)."""
    return _TARGET.get()


class DeprecatedParameter(FutureWarning):
    """A parameter given under its former name: accepted for one release, under its new name."""


def rename_message(old: str, new: str, owner: str) -> str:
    return (
        f"parameter {old!r} of {owner} is now {new!r}: the old name is accepted for one release "
        f"(records use {new!r}); rename it in your notebook, YAML set or --param"
    )


def check_choice(param: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(param, value, "one of " + ", ".join(repr(a) for a in allowed))


def check_choices(param: str, values: Any, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ConfigError(param, values, "a list drawn from " + ", ".join(repr(a) for a in allowed))
    if not values:
        raise ConfigError(param, values, "a non-empty list drawn from " + ", ".join(repr(a) for a in allowed))
    for v in values:
        if v not in allowed:
            raise ConfigError(param, values, f"every item one of {', '.join(repr(a) for a in allowed)} ({v!r} is not)")


def check_int(param: str, value: Any, *, min: int | None = None, max: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(param, value, "an integer")
    if min is not None and value < min:
        raise ConfigError(param, value, f"an integer >= {min}")
    if max is not None and value > max:
        raise ConfigError(param, value, f"an integer <= {max}")


def check_float(
    param: str, value: Any, *, min: float | None = None, max: float | None = None, min_exclusive: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(param, value, "a number")
    if min is not None and (value <= min if min_exclusive else value < min):
        raise ConfigError(param, value, f"a number {'>' if min_exclusive else '>='} {min}")
    if max is not None and value > max:
        raise ConfigError(param, value, f"a number <= {max}")


def check_int_list(param: str, value: Any, *, min: int | None = None, nonempty: bool = True) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(param, value, "a list of integers")
    if nonempty and not value:
        raise ConfigError(param, value, "a non-empty list of integers")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or (min is not None and v < min):
            raise ConfigError(
                param, value, f"a list of integers{f' >= {min}' if min is not None else ''} ({v!r} is not)"
            )


def check_bool(param: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(param, value, "True or False")


_BUILT_FROM = "perflab_built_from"


def built_from(build: Callable[..., Any], params: Iterable[str]) -> Any:
    """A field holding a config built once from some of its holder's parameters: when the holder
    is built, :meth:`LabConfig.__post_init__` calls ``build(**{p: holder.p for p in params})``, so
    those values are checked once, by the config they belong to (with its error text), and the
    holder's own module never handles them.  Not a parameter: left out of ``__init__``, ``repr``,
    comparisons and :meth:`LabConfig.to_dict`."""
    meta = {_BUILT_FROM: (build, tuple(params))}
    return dataclasses.field(init=False, repr=False, compare=False, metadata=meta)


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """Base for a lab's parameters.  Subclasses are frozen dataclasses whose field
    names are exactly the notebook's parameter names; they validate in ``__post_init__``.

    ``RENAMED`` maps a parameter's former name to its name now: :meth:`from_params` accepts
    the old name for one release, with a :class:`DeprecatedParameter` warning naming both."""

    RENAMED: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self):
        """Build the fields declared with :func:`built_from`, in field order: the one place where
        a config's flat parameters are mapped into the configs it holds.  A subclass that checks
        its own parameters in ``__post_init__`` calls this first (``super().__post_init__()``)."""
        for f in dataclasses.fields(self):
            if _BUILT_FROM in f.metadata:
                build, params = f.metadata[_BUILT_FROM]
                object.__setattr__(self, f.name, build(**{p: getattr(self, p) for p in params}))

    @classmethod
    def param_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def renamed_params(cls, params: Mapping[str, Any], *, old_wins: bool = True) -> dict[str, Any]:
        """``params`` with every former name (:attr:`RENAMED`) under its new name, each with a
        warning naming old and new.  Where both names are present the old one's value is kept
        when ``old_wins`` (a notebook's globals: papermill injected the old name after the
        parameters cell set the new one); otherwise both together are a ConfigError."""
        out = dict(params)
        for old, new in cls.RENAMED.items():
            if old not in out:
                continue
            value = out.pop(old)
            if new in out and not old_wins and out[new] != value:
                raise ConfigError(old, value, f"one name only: {old!r} was renamed {new!r}, and both are given")
            warnings.warn(rename_message(old, new, cls.__name__), DeprecatedParameter, stacklevel=3)
            out[new] = value
        return out

    @classmethod
    def from_params(cls, params: Mapping[str, Any], *, strict: bool = False):
        """Build from a mapping (a notebook's ``globals()``, a YAML set): the one place where
        flat parameters become a config.  Former names are mapped (:meth:`renamed_params`);
        extra keys are ignored unless ``strict``, in which case an unknown key is a ConfigError."""
        params = cls.renamed_params(params)
        names = set(cls.param_names())
        if strict:
            for k in params:
                if k not in names:
                    raise ConfigError(k, params[k], f"a parameter of {cls.__name__}: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in params.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The parameters by name (fields built from them, ``init=False``, are left out)."""
        return {n: _plain(getattr(self, n)) for n in self.param_names()}


def _plain(v: Any) -> Any:
    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else copy.deepcopy(v)

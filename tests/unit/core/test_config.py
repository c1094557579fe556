import dataclasses

import pytest

from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_choices,
    check_float,
    check_int,
    check_int_list,
)


def test_error_names_parameter_value_and_rule():
    with pytest.raises(ConfigError) as e:
        check_choice("dtype", "float13", ["float32", "bfloat16"])
    msg = str(e.value)
    assert "'dtype'" in msg and "'float13'" in msg and "'bfloat16'" in msg
    assert e.value.param == "dtype" and e.value.value == "float13"


@pytest.mark.parametrize(
    "fn,args",
    [
        (
            check_int,
            ("batch_size", 0),
        ),
        (check_int, ("batch_size", 2.5)),
        (check_int, ("batch_size", True)),
        (check_float, ("lr", "x")),
        (check_int_list, ("sizes", [])),
        (check_int_list, ("sizes", [1, -2])),
        (check_int_list, ("sizes", "12")),
        (check_choices, ("ops", [])),
        (check_bool, ("compile", 1)),
    ],
)
def test_checks_refuse(fn, args):
    kwargs = {"min": 1} if fn in (check_int, check_int_list) else {}
    if fn is check_choices:
        kwargs = {}
        args = (*args, ["a"])
    with pytest.raises(ConfigError, match=repr(args[0])):
        fn(*args, **kwargs)


def test_checks_accept():
    check_int("n", 3, min=1, max=3)
    check_float("lr", 1e-4, min=0, min_exclusive=True)
    check_choices("ops", ["a", "b"], ["a", "b", "c"])
    check_int_list("sizes", [1, 2], min=1)
    check_bool("flag", False)


@dataclasses.dataclass(frozen=True)
class _Cfg(LabConfig):
    steps: int = 3
    dtype: str = "float32"

    def __post_init__(self):
        check_int("steps", self.steps, min=1)
        check_choice("dtype", self.dtype, ["float32", "bfloat16"])


def test_from_params_picks_fields_and_validates():
    cfg = _Cfg.from_params({"steps": 5, "unrelated": object(), "dtype": "bfloat16"})
    assert cfg.to_dict() == {"steps": 5, "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="'steps'"):
        _Cfg.from_params({"steps": 0})
    with pytest.raises(ConfigError, match="'unrelated'"):
        _Cfg.from_params({"unrelated": 1}, strict=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 2

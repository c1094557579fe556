"""A Ctrl-C that arrives while a job is being submitted is held until the job is registered, then
stops the run whatever SIGINT's handler was (a Python one, the default action, or one installed
outside Python), unless SIGINT is ignored; the handler is restored either way."""

import os
import signal

import pytest

from lab_utils.run.executors import _interrupt_after


@pytest.fixture
def sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


def _ctrl_c_inside():
    registered = []
    with _interrupt_after():
        os.kill(os.getpid(), signal.SIGINT)
        registered.append("job")  # the submission goes on to its end
    return registered


@pytest.mark.parametrize("handler", [signal.default_int_handler, signal.SIG_DFL], ids=["python", "default"])
def test_a_ctrl_c_held_during_a_submission_stops_the_run_once_it_is_registered(sigint, handler):
    signal.signal(signal.SIGINT, handler)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupt_after():
            os.kill(os.getpid(), signal.SIGINT)
            seen.append("registered")
    assert seen == ["registered"]
    assert signal.getsignal(signal.SIGINT) == handler


def test_a_python_handler_is_called_with_the_held_signal(sigint):
    calls = []
    signal.signal(signal.SIGINT, lambda s, _f: calls.append(s))
    assert _ctrl_c_inside() == ["job"] and calls == [signal.SIGINT]


def test_an_ignored_sigint_stays_ignored(sigint):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert _ctrl_c_inside() == ["job"]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_no_ctrl_c_no_interrupt(sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with _interrupt_after():
        pass
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler

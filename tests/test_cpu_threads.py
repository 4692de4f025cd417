"""The CPU runner builds its model on a short-lived thread (engine/runner/cpu_threads.py):
what the build returns or raises must reach the caller unchanged."""
import threading

import pytest

from enc2dec.engine.runner.cpu_threads import on_fresh_thread


def test_returns_the_result_computed_on_another_thread():
    caller = threading.get_ident()
    result = on_fresh_thread(lambda: ("built", threading.get_ident()))
    assert result[0] == "built" and result[1] != caller


def test_a_load_error_reaches_the_caller_with_its_type_and_message():
    def bad_load():
        raise ValueError("load_format='bogus' is not supported")

    with pytest.raises(ValueError, match="load_format='bogus'"):
        on_fresh_thread(bad_load)

"""The console scripts' Ctrl-C guard around the CLI's imports (`loopline.entry`)."""

from __future__ import annotations

import signal
import sys

import pytest

from loopline import entry

WRAPS_THE_KEY = """
import os, signal
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt as key:  # as pydantic's validator builder does: the key comes out as another error
    raise RuntimeError(f"SchemaError: {key!r}") from None
"""


def _module(tmp_path, monkeypatch, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_ctrl_c_that_an_import_turns_into_another_error_is_still_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """CI: a Ctrl-C during `loopline train`'s imports reached pydantic building a validator, which raised its
    `SchemaError` (holding the KeyboardInterrupt): the user read a 60-line traceback."""
    _module(tmp_path, monkeypatch, "wraps_the_key", WRAPS_THE_KEY)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        entry._run("wraps_the_key")
    assert stopped.value.code == 130
    assert capsys.readouterr().err == entry.STOPPED_BEFORE + "\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_an_import_error_without_a_ctrl_c_is_not_hidden(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "broken_cli", "raise RuntimeError('a real defect')\n")
    with pytest.raises(RuntimeError, match="a real defect"):
        entry._run("broken_cli")

"""store.nul: what tools produce (NUL characters) survives the ledger exactly, and nothing an agent writes
reads back as something else."""

from loopline.store.nul import TAG, restored, storable, text


def _holds_no_nul(value) -> bool:
    return "\x00" not in repr(value)


def test_strings_with_nul_round_trip_and_the_stored_form_holds_none():
    value = {"output": "\x7fELF\x00\x00", "args": ["\x00", "plain", 3, None, 1.5], "nested": {"x": "a\x00b\x00"}}
    stored = storable(value)
    assert _holds_no_nul(stored) and stored["output"] == {TAG: ["\x7fELF", "", ""]}
    assert restored(stored) == value


def test_an_object_that_looks_encoded_reads_back_as_itself():
    for looks in ({TAG: ["a", "b"]}, {TAG: {"v": "x"}}, {TAG: "s"}):
        assert restored(storable(looks)) == looks


def test_free_text_shows_nul_escaped():
    assert text("bad\x00byte") == "bad\\x00byte" and text(None) is None

"""A failure recorded in a report names no folder of the machine it ran on."""

from __future__ import annotations

from matepoint_examples.bench._errors import error_note, portable


def test_paths_are_cut_to_their_place_in_their_package() -> None:
    text = (
        'File "/srv/copy/of/the/tree/packages/matepoint-core/src/matepoint/_checkpoint.py", '
        "line 219\n  File /opt/env/lib/python3.12/site-packages/torch/_ops.py, line 8"
    )
    assert portable(text) == (
        'File "packages/matepoint-core/src/matepoint/_checkpoint.py", line 219\n'
        "  File torch/_ops.py, line 8"
    )
    assert portable("a relative src/x.py and no path") == "a relative src/x.py and no path"


def test_an_error_note_is_its_type_and_message_without_paths_at_most_500_characters() -> None:
    note = error_note(RuntimeError("failed in /a/b/site-packages/torch/library.py" + "x" * 600))
    assert note.startswith("RuntimeError: failed in torch/library.py")
    assert len(note) == 500

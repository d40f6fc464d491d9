"""What a ``resume_from_checkpoint`` value asks for: nothing, the newest complete checkpoint, "auto", or a path.

Scripts pass it through ``HfArgumentParser``, which leaves ``--resume_from_checkpoint true`` a string; the words
mean the same whatever their case, here, in ``trainer_ext.train`` and on the command line.
"""

from __future__ import annotations

import os

from trainer_ext.values import FALSE_WORDS, TRUE_WORDS

AUTO = "auto"
# the one boolean vocabulary (values.py), plus what only a resume request can mean
NEWEST_WORDS = (*TRUE_WORDS, "latest", "last")
NO_WORDS = (*FALSE_WORDS, "none", "")


def resume_request(value: str | os.PathLike | bool | None) -> bool | str | None:
    """None (start fresh), True (the newest complete checkpoint, an error if none), ``"auto"`` (that one if any,
    else start fresh) or the checkpoint path as given."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    word = str(value).strip().lower()
    if word in NO_WORDS:
        return None
    if word == AUTO:
        return AUTO
    if word in NEWEST_WORDS:
        return True
    return os.fspath(value)

"""What a call refuses: the text of the ValueError it raises, for tests that collect several refusals in one
launch and check each message."""
from __future__ import annotations


def refusal(call) -> str:
    """The message of the ValueError `call()` raises; the empty string when it raises none."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return ""

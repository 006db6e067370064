# Copyright 2026 The path-hf authors. Apache-2.0.
"""The one exception type of the converter."""


class ConversionError(Exception):
    """A conversion was refused or failed; the message says why and what to do about it.

    The CLI prints it as one line (`error: <message>`) and exits with a nonzero code; nothing is left at the
    destination.
    """


__all__ = ["ConversionError"]

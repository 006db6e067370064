# Copyright 2026 The path-hf authors. Apache-2.0.
"""The exceptions of `path-hf`: a refusal or failure whose message says what to do; the CLI prints it on one line."""


class CommandError(Exception):
    """A `path-hf` command was refused or failed; printed as `error: <message>`, exit code 1."""


class SourceError(CommandError):
    """A model, config or tokenizer that `path_hf.loading` cannot find or read (a missing path, a damaged GGUF); each
    command (the converter, the evaluation, the recipes) re-raises it as its own error type, naming the option that
    gave the source."""


class ConversionError(CommandError):
    """A conversion was refused or failed; the message says why and what to do about it.

    The CLI prints it as one line (`error: <message>`) and exits with a nonzero code; nothing is left at the
    destination.
    """


class EvaluationError(CommandError):
    """An evaluation (`path-hf eval`, `path_hf.evaluation.evaluate`) was refused or failed; nothing was written."""


class RecipeError(CommandError):
    """A configuration the recipe refuses, or a run that cannot go on; the message names the field or the step."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none: what a one-line refusal quotes."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


__all__ = ["CommandError", "ConversionError", "EvaluationError", "RecipeError", "SourceError", "first_line"]

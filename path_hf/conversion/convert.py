# Copyright 2026 The path-hf authors. Apache-2.0.
"""`convert`, what `path-hf convert` runs: plan a conversion from headers and config alone (`plan`), then stream it
into a new directory (`write`), optionally verified (`verify`). `path_hf.cli` and conversion/convert.py parse the
flags into a `ConvertOptions` and call it; the recipes call it to convert a model on the fly.

Everything goes to a staging directory beside the destination, renamed into place at the end (`staging`); a GGUF
source is first materialised as a checkpoint beside it (`gguf`). Ctrl-C, SIGTERM or an error delete both: there is
never a partial destination. The destination's lock is held throughout: two conversions to it never run at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_directory
from ..errors import ConversionError, SourceError
from ..loading import TOKENIZER_FILES
from .gguf import gguf_source
from .options import ConvertOptions, format_size
from .plan import ConversionPlan, plan_conversion
from .sources import resolve_source
from .staging import check_destination, clear_stale_staging, destination_lock, staging_directory
from .write import write_conversion

if TYPE_CHECKING:
    from .verify import VerifyResult


@dataclass(frozen=True)
class Conversion:
    """What `convert` did: the plan it followed and, with `--verify`, what the verification measured."""

    plan: ConversionPlan
    verification: VerifyResult | None = None


def convert(options: ConvertOptions) -> Conversion:
    """Run a conversion as `path-hf convert` does: plan, print the plan, and (unless `--dry-run`) write and optionally
    verify the converted checkpoint, atomically. The destination is checked first, once (`check_destination`), then
    locked until the output is in place (`destination_lock`: a second conversion to it is refused meanwhile). Staging
    directories that killed conversions to the same destination left are removed next (`clear_stale_staging`). A
    GGUF source is materialised beside the destination, and removed at the end whatever happens. With
    `--retrieval-layers` (or `--full-heads`) the source runs first, to choose the PaTH layers (or the full heads:
    `retrieval`). A failed verification raises `VerificationFailed`, which holds what it measured. A source that
    cannot be found or read (`path_hf.loading`'s `SourceError`) raises `ConversionError` with the same message."""
    try:
        return _convert(options)
    except SourceError as error:
        raise ConversionError(str(error)) from error


def _convert(options: ConvertOptions) -> Conversion:
    output = Path(options.output).expanduser().resolve()
    local = Path(options.source).expanduser()
    # Once, before anything is made beside it; the GGUF file and a hub snapshot, known later, are checked against
    # it then (`check_overlap`).
    check_destination(output, options.force, local.resolve() if local.exists() else None)
    with destination_lock(output, create_parent=not options.dry_run):
        clear_stale_staging(output, remove=not options.dry_run)
        with gguf_source(options) as source:
            if options.retrieval_layers is not None or options.full_heads is not None:
                from .retrieval import (
                    choose_retrieval_layers,  # runs the source: imported only when asked for
                )

                source = source or resolve_source(options.source, options.revision)
                options = choose_retrieval_layers(options, source)
            plan = plan_conversion(options, source)
            print(plan.describe(), flush=True)
            if options.dry_run:
                return Conversion(plan)
            staging, old = staging_directory(output, "tmp"), staging_directory(output, "old")
            with atomic_directory(output, staging, old):
                start = time.perf_counter()
                write_conversion(plan, staging)
                seconds = time.perf_counter() - start
                verification = None
                if options.verify:
                    from .verify import verify_conversion  # builds models: imported only when asked for

                    verification = verify_conversion(plan, staging)
                    print(verification.describe(), flush=True)
                    verification.check()
            print(f"wrote {output} ({format_size(plan.bytes_to_write)} in {seconds:.1f} s)", flush=True)
            if not plan.has_tokenizer:
                print(
                    f"note: the source has no tokenizer files ({', '.join(TOKENIZER_FILES)}), so {output.name} has "
                    "none: copy the source's tokenizer into it before evaluating or training it",
                    flush=True,
                )
    return Conversion(plan, verification)


__all__ = ["Conversion", "convert"]

# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf eval`: perplexity, passkey and copy retrieval at several context lengths, for several causal LMs at once.

```
path-hf eval --model source=meta-llama/Llama-3.2-1B --model yarn=meta-llama/Llama-3.2-1B@yarn \\
    --model path=./Llama-3.2-1B-PaTH --data held_out.jsonl --lengths 2048,4096,8192,16384 \\
    --output eval.json --plot eval.png
```

The command runs `path_hf.evaluation.evaluate` on its options (`EvalOptions`: a model is `[LABEL=]PATH[@ROPE[:FACTOR]]`,
`ModelSpec`), prints each model's numbers at each length as they come (stderr) and the table of them all (stdout), and
writes `--output` and `--plot` (`write_report`). What is refused, and when, is the library's: `EvalOptions.check`
before any model is loaded, `path_hf.evaluation.checks` before any is evaluated.
"""

from __future__ import annotations

import sys

from ..evaluation.options import EvalOptions, ModelSpec
from ..evaluation.report import format_table, write_report
from ..evaluation.results import EvalReport, LengthResult
from ..evaluation.run import evaluate


def progress_line(result: LengthResult) -> str:
    """One length's numbers on one line (the progress printout)."""
    parts = [f"ppl {result.perplexity.ppl:9.3f}"] if result.perplexity is not None else []
    for kind in ("passkey", "multikey"):
        score = result.needle(kind)
        if score is not None and score.summary is not None:
            low, high = score.summary.wilson95
            parts.append(f"{kind} {score.summary.found}/{score.summary.trials} [{low:.0%}, {high:.0%}]")
    if result.copy is not None and result.copy.accuracy is not None:
        parts.append(f"copy {result.copy.accuracy:6.1%} (nll {result.copy.nll:.3f})")
    return "  ".join(parts)


def print_length(spec: ModelSpec, length: int, result: LengthResult) -> None:
    """A model's result at one length, on stderr, as soon as it is measured."""
    took = "the unscaled model's" if result.same_as_unscaled else f"{result.seconds:.1f} s"
    print(f"{spec.label:>24}  {length:>6}  {progress_line(result)}  ({took})", file=sys.stderr)


def run_eval(options: EvalOptions) -> EvalReport:
    """Evaluate every model of `options`; print the table, write the JSON and the plot; returns the report."""
    report = evaluate(options, on_length=print_length)
    print(format_table(report))
    # without --force, an output that another run made meanwhile is kept, and so are these results
    write_report(report, options.output, options.plot, force=options.force)
    return report


__all__ = ["print_length", "progress_line", "run_eval"]

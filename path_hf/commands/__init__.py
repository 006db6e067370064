# Copyright 2026 The path-hf authors. Apache-2.0.
"""The commands of `path-hf` (`path_hf.cli` parses their flags): `convert` (`path-hf convert`, over the `conversion`
package) and `eval` (`path-hf eval`, over `evaluation`). Each loads its sources through `path_hf.loading` and raises
its own error type (`ConversionError`, `EvaluationError`)."""

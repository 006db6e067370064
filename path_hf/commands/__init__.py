# Copyright 2026 The path-hf authors. Apache-2.0.
"""The commands of `path-hf` that hold more than a library call (`path_hf.cli` parses their flags): `eval`
(`path-hf eval`, over `evaluation`) and `serve` (`path-hf serve`, over `serving`). `path-hf convert` calls
`path_hf.conversion.convert.convert` directly."""

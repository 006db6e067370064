# Copyright 2026 The path-hf authors. Apache-2.0.
"""The positional-encoding lab (README.md): `python -m lab.pe_lab` from the repository root."""

#!/usr/bin/env bash
# The GPU benchmark's entry: bench/gpu/run.sh with the same arguments and environment. Everything for the offline GPU
# machine (the scripts, the wheels, the model's parts) lives in bench/gpu/; bench/gpu/README.md says how to run it.
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu/run.sh" "$@"

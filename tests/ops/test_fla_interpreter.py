"""FLA's Triton kernel (`parallel_path_attn`) against our torch backend, on CPU through TRITON_INTERPRET=1.

The kernels run once, in a child process (see fla_interpreter_worker.py), on inputs made here; the tests then
compare its outputs and gradients with the torch backend's on the same inputs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from path_hf.ops import path_attention
from tests.ops.path_reference import assert_close, make_inputs

pytestmark = pytest.mark.fla

WORKER = Path(__file__).with_name("fla_interpreter_worker.py")
REPO_ROOT = Path(__file__).parents[2]
NAMES = ("q", "k", "v", "w", "beta", "g")

# name -> (B, T, HQ, H, D, gate, cu_seqlens); FLA supports head dims 16, 32, 64, 128. The interpreter runs every
# Triton program instance in Python, so cost grows with B * HQ * T: keep these small.
CASES = {
    "B1-T128-HQ2-H2-D32": (1, 128, 2, 2, 32, False, None),
    "B1-T100-HQ4-H2-D32-gate": (1, 100, 4, 2, 32, True, None),
    "cu0-20-90-128-HQ2-H1-D16-gate": (1, 128, 2, 1, 16, True, [0, 20, 90, 128]),
}
# path_attention(backend="fla") is checked on one case that passes everything through: g, cu_seqlens, k_cache.
API_CASE = "cu0-20-90-128-HQ2-H1-D16-gate"


def make_case(B: int, T: int, HQ: int, H: int, D: int, gate: bool, cu_seqlens: list[int] | None) -> dict:
    x = make_inputs(B, T, HQ, H, D, gate=gate, dtype=torch.float32, seed=T + HQ)
    case = {name: None if t is None else t.detach() for name, t in x.items()}
    case["do"] = torch.randn(B, T, HQ, D, generator=torch.Generator().manual_seed(1))
    case["cu_seqlens"] = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    return case


@pytest.fixture(scope="module")
def fla_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    cases = {name: make_case(*shape) for name, shape in CASES.items()}
    cases[API_CASE]["api"] = True
    folder = tmp_path_factory.mktemp("fla_interpreter")
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(
        [sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "results.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, f"FLA interpreter worker failed:\n{process.stderr[-5000:]}"
    return cases, torch.load(folder / "results.pt")


def torch_backend(case: dict) -> dict[str, torch.Tensor]:
    inputs = {name: None if case[name] is None else case[name].clone().requires_grad_() for name in NAMES}
    o, k_cache = path_attention(**inputs, cu_seqlens=case["cu_seqlens"], backend="torch", return_k_cache=True)
    leaves = {name: x for name, x in inputs.items() if x is not None}
    grads = torch.autograd.grad(o, list(leaves.values()), case["do"])
    return {"o": o.detach(), "k_cache": k_cache, **{f"d{name}": grad for name, grad in zip(leaves, grads, strict=True)}}


@pytest.mark.parametrize("name", CASES)
def test_fla_kernel_vs_torch_backend(fla_results, name):
    cases, results = fla_results
    ref = torch_backend(cases[name])
    out = results[name]["fla"]
    assert out.keys() == ref.keys()
    # FLA keeps w in float16 between chunks: errors reach ~6e-5
    for key in ref:
        assert_close(key, ref[key], out[key], 5e-4)


def test_path_attention_dispatches_to_fla(fla_results):
    _, results = fla_results
    api = results[API_CASE]["api"]
    assert not isinstance(api, str), f"path_attention(backend='fla') on CPU under the interpreter raised {api}"
    for key, expected in results[API_CASE]["fla"].items():
        assert_close(key, expected, api[key], 1e-6)

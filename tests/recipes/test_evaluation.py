"""path_hf.evaluation against a direct computation of the negative log-likelihood."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from path_hf import PaTHLlamaForCausalLM
from path_hf.evaluation import IGNORE_INDEX, make_windows, perplexity
from tests.tiny import tiny_config

VOCAB = 61
FIELDS = dict(vocab_size=VOCAB, num_key_value_heads=4, initializer_range=0.2)  # over `tests.tiny.SHAPES`: no GQA


@pytest.fixture(scope="module", params=["llama", "path"])
def model(request):
    torch.manual_seed(0)
    if request.param == "llama":
        return LlamaForCausalLM(tiny_config("llama", **FIELDS)).eval()
    return PaTHLlamaForCausalLM(tiny_config("path", **FIELDS, path_backend="torch")).eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def direct_nll(model, context: torch.Tensor, target: int) -> float:
    """-log p(target | context), one forward pass of the context alone."""
    with torch.no_grad():
        logits = model(input_ids=context[None]).logits[0, -1]
    return -F.log_softmax(logits.double(), -1)[target].item()


def test_non_overlapping_windows_match_a_direct_computation(model):
    stream = tokens(37)
    result = perplexity(model, stream, context_length=10, batch_size=3)
    # Windows [0,10) [10,20) [20,30) [30,37): each scores all its tokens but the first, from its own window only.
    expected, count = 0.0, 0
    for begin in range(0, 37, 10):
        for t in range(begin + 1, min(begin + 10, 37)):
            expected += direct_nll(model, stream[begin:t], stream[t].item())
            count += 1
    assert result.tokens == count == 37 - 4
    assert result.nll_sum == pytest.approx(expected, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(expected / count), rel=1e-5)


def test_sliding_windows_score_every_token_once_with_the_longest_context(model):
    stream = tokens(30, seed=1)
    result = perplexity(model, stream, context_length=12, stride=4, batch_size=2)
    expected = 0.0
    for t in range(1, 30):
        # The window scoring token t starts at the largest multiple of the stride that still keeps t in it.
        begin = max(0, math.ceil((t + 1 - 12) / 4) * 4)
        expected += direct_nll(model, stream[begin:t], stream[t].item())
    assert result.tokens == 29
    assert result.nll_sum == pytest.approx(expected, rel=1e-5)


def test_documents_never_see_each_other(model):
    documents = [tokens(9, seed=2), tokens(14, seed=3)]
    together = perplexity(model, documents, context_length=32)
    apart = [perplexity(model, document, context_length=32) for document in documents]
    assert together.tokens == 8 + 13
    assert together.nll_sum == pytest.approx(sum(part.nll_sum for part in apart), rel=1e-6)
    # The same tokens as one stream: the second document is read in the context of the first.
    assert perplexity(model, torch.cat(documents), context_length=32).nll_sum != pytest.approx(together.nll_sum)


def test_windows_and_their_checks():
    windows = make_windows(list(range(10)), context_length=4, stride=2)
    assert [w.input_ids.tolist() for w in windows] == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9]]
    assert [w.labels.tolist() for w in windows][1] == [IGNORE_INDEX, IGNORE_INDEX, 4, 5]
    assert sum(w.scored for w in windows) == 9
    with pytest.raises(ValueError, match="stride"):
        make_windows(list(range(10)), context_length=4, stride=5)
    with pytest.raises(ValueError, match="context_length"):
        make_windows(list(range(10)), context_length=1)

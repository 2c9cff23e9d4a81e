"""`apply_grammar_bitmask` against a plain per-token reference: bitmask row i masks logits row
logit_rows[i] (bit set: allowed); other rows are untouched."""

import numpy as np
import pytest
import torch

from v1.worker.model_runner import apply_grammar_bitmask


def reference(logits: torch.Tensor, bitmask: np.ndarray, logit_rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(logit_rows):
        for token in range(logits.shape[1]):
            word, bit = divmod(token, 32)
            if not (int(bitmask[i, word]) >> bit) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy path; torch path
@pytest.mark.parametrize("vocab_size", [64, 100])  # whole words; a partial last word
def test_masks_the_forbidden_tokens_of_the_given_rows(dtype, vocab_size):
    rng = np.random.default_rng(0)
    logits = torch.randn(5, vocab_size).to(dtype)
    words = (vocab_size + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2, :] = 0
    bitmask[2, 0] = 1 << 5  # one token allowed
    rows = [4, 0, 2]
    expected = reference(logits, bitmask, rows)
    apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[[1, 3]]).all()
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[2]).sum() == 1 and torch.isfinite(logits[2, 5])

"""The greedy verification a verification graph replays, against the rejection sampler's greedy path."""

import torch

from deepinfer_core.spec_decode.rejection_sampler import greedy_verify
from deepinfer_core.spec_decode.verify_graph import greedy_verify_spans


def test_greedy_verify_spans_matches_greedy_verify_and_marks_the_rejected_tokens():
    gen = torch.Generator().manual_seed(0)
    s, span, vocab, padded = 3, 4, 11, 4  # three real spans in a graph of four, plus a partial one
    logits = torch.randn(padded * span + 2, vocab, generator=gen)
    best = logits.argmax(-1).view(-1)
    ids = torch.randint(vocab, (padded * span + 2,), generator=gen)
    # span 0 matches its first two drafts, span 1 all three, span 2 none
    ids[1:3] = best[0:2]
    ids[5:8] = best[4:7]
    ids[9] = (best[8] + 1) % vocab
    num_drafts = torch.tensor([3, 2, 3])
    out, rejected = greedy_verify_spans(logits, ids, num_drafts, span, padded * span + 2)
    want = greedy_verify(logits[: s * span].view(s, span, vocab), ids[: s * span].view(s, span)[:, 1:], num_drafts)
    assert torch.equal(out.output_token_ids, want.output_token_ids)
    assert out.num_accepted.tolist() == [2, 2, 0]
    offset, owner = torch.arange(len(rejected)) % span, torch.arange(len(rejected)) // span
    accepted = torch.tensor([2, 2, 0, 0, 0])
    assert torch.equal(rejected, offset > accepted[owner])
    assert rejected.tolist()[:12] == [False, False, False, True, False, False, False, True,
                                      False, True, True, True]

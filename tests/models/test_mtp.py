"""The MTP module (DeepSeek's ``mtp.0.*`` layout) against a transformers block built from the same tensors."""

import pytest
import torch

from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.models import load_model
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint, load_hf_model, load_hf_mtp_reference


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), "tiny", seed=5)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_draft_logits_match_transformers_block(mtp_checkpoint):
    hf = load_hf_model(mtp_checkpoint, torch.float64)
    model = load_model(mtp_checkpoint, dtype=torch.float64)
    assert model.has_mtp
    ids = torch.randint(2, hf.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    captured = {}
    hook = hf.model.hc_head.register_forward_hook(lambda mod, args, out: captured.update(streams=args[0]))
    with torch.no_grad():
        hf(ids)
    hook.remove()
    hf_streams = captured["streams"][0]

    # Independent reference: e = enorm(embed(t+1)), h = hnorm(streams_t), x = e_proj(e) + h_proj(h),
    # then transformers' own decoder block / hc head / norm / head loaded from the mtp.0 tensors.
    ref, e_proj, h_proj, enorm, hnorm = load_hf_mtp_reference(mtp_checkpoint, torch.float64)
    eps = hf.config.rms_norm_eps
    nxt = ids[0, 1:]
    n = nxt.shape[0]
    e = _rms(hf.model.embed_tokens(nxt), enorm, eps) @ e_proj.T
    x = e.unsqueeze(1) + _rms(hf_streams[:n], hnorm, eps) @ h_proj.T
    hook = ref.model.layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: ((x.unsqueeze(0),) + args[1:], kwargs), with_kwargs=True
    )
    with torch.no_grad():
        ref_logits = ref(inputs_embeds=torch.zeros(1, n, hf.config.hidden_size, dtype=torch.float64)).logits[0]
    hook.remove()

    runner = SimpleRunner(model, 1, 64)
    spans = [SeqSpan(0, 30, runner.table(0), runner.table(0), 0)]
    batch = build_forward_batch(ids[0].tolist(), spans, model.compressor_specs(), 16, 8, list(range(30)))
    _, streams = model.forward(batch, runner.cache)
    assert (streams - hf_streams).abs().max() < 1e-4
    mtp_spans = [SeqSpan(0, n, runner.table(0), runner.table(0), 0)]
    mtp_batch = build_forward_batch(ids[0].tolist()[:n], mtp_spans, model.compressor_specs(), 16, 8, list(range(n)))
    draft, _ = model.drafter.forward(mtp_batch, runner.cache, streams[:n], nxt)
    scale = ref_logits.abs().max()
    assert torch.isfinite(draft).all()
    assert (draft - ref_logits).abs().max() <= 1e-4 * scale


def test_checkpoint_without_mtp_loads_and_refuses_drafts(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "tiny_hc1", seed=1, with_mtp=False)
    model = load_model(path, dtype=torch.float64)
    assert not model.has_mtp
    with pytest.raises(ValueError, match="no mtp"):
        model.mtp_forward(None, None, None, None)

"""DeepSeek-V4's canonical tensor names (DeepSeek's published ones) and the other exports' names that map
to them."""

from __future__ import annotations

import re

__all__ = ["RENAMES", "canonical_name"]

#: transformers' in-memory names (``model.layers.N.self_attn.q_a_proj.weight``, the merged
#: ``mlp.experts.gate_up_proj``) and what its ``save_pretrained`` writes -> DeepSeek's, applied in order;
#: DeepSeek's own names (with or without ``model.``) pass unchanged
RENAMES = [(re.compile(p), r) for p, r in [
    (r"^model\.", ""),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.gate_up_proj$", ".experts.w13"),
    (r"\.experts\.down_proj$", ".experts.w2"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"^((?:layers|mtp)\.\d+\.attn\.)norm\.weight$", r"\1kv_norm.weight"),
    (r"\.weight_scale_inv$", ".scale"),
]]


def canonical_name(name: str) -> str:
    """The engine's name of a checkpoint tensor: DeepSeek's published one (``layers.3.attn.kv_norm.weight``,
    block scales as ``.scale``), from DeepSeek's names with or without ``model.``, from what transformers'
    ``save_pretrained`` writes, or from transformers' in-memory module names."""
    for pattern, repl in RENAMES:
        name = pattern.sub(repl, name)
    return name

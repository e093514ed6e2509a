"""Routing-capture checks: the experts a plain forward picks for a completion's tokens, against the engine's record."""

import torch

from areno.models.attention_metadata import AttentionMetadata


def assert_recorded_routes_are_the_forwards(model, completion) -> None:
    """``completion.routed_experts`` ([tokens, MoE layers, k], -1 for the last token, never fed) holds, per token and
    layer, the experts a plain forward over the same tokens chooses (as sets)."""
    ids = completion.prompt_ids + completion.token_ids
    t = len(ids)
    dev = next(model.parameters()).device
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    meta = AttentionMetadata(None, True, cu, cu, t, t)
    meta.routing_out = torch.full((model.num_moe_layers, t, model.moe_top_k), -1, dtype=torch.int32, device=dev)
    with torch.no_grad():
        model(torch.tensor(ids, device=dev), torch.arange(t, device=dev), attn_metadata=meta)
    got = torch.from_numpy(completion.routed_experts).long()
    assert got.shape == (t, model.num_moe_layers, model.moe_top_k)
    assert (got[-1] == -1).all() and (got[:-1] >= 0).all()
    want = meta.routing_out.permute(1, 0, 2).long().cpu()[:-1]
    assert torch.equal(got[:-1].sort(-1).values, want.sort(-1).values)

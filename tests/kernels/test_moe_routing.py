"""MoE routers (Triton, interpreted on CPU, and native) against transformers' Qwen3-MoE and DeepSeek-V3 routers."""

import pytest
import torch

from areno.kernels.moe.fused import route_sigmoid_grouped_topk, route_softmax_topk
from areno.kernels.moe.routing import route_sigmoid_grouped_topk_native

PATHS = ["triton_kernels", "native_kernels"]


def _untied_rows(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows whose top-(k+1) scores are all distinct: there the chosen ids are unambiguous."""
    top = scores.topk(min(top_k + 1, scores.shape[-1]), dim=-1).values
    return (top[:, :-1] != top[:, 1:]).all(dim=-1)


def _check_counts(ids, counts, E):
    assert counts.dtype == torch.int32 and counts.shape == (E,)
    torch.testing.assert_close(counts, torch.bincount(ids.reshape(-1).long(), minlength=E).int(), rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,top_k,renorm", [(1, 8, 2, True), (7, 8, 2, False), (33, 12, 3, True), (33, 8, 1, True)])
def test_softmax_topk_matches_transformers_qwen3_moe(path, dtype, T, E, top_k, renorm, request):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    request.getfixturevalue(path)
    cfg = Qwen3MoeConfig(hidden_size=64, num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=renorm)
    router = Qwen3MoeTopKRouter(cfg).to(dtype)
    torch.nn.init.normal_(router.weight, std=0.3)
    hidden = torch.randn(T, 64, dtype=dtype)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden)
    w, ids, counts = route_softmax_topk(logits, top_k, renormalize=renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (T, top_k)
    # transformers casts the weights back to the logits' dtype; areno hands back fp32
    torch.testing.assert_close(w.to(dtype), hf_w)
    ok = _untied_rows(logits.float(), top_k)
    assert ok.float().mean() > 0.5
    torch.testing.assert_close(ids[ok].long(), hf_ids[ok], rtol=0, atol=0)
    ref_w = torch.softmax(logits.double(), -1).gather(1, ids.long())
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)
    _check_counts(ids, counts, E)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T,E,top_k,n_group,topk_group,renorm", [
    (1, 8, 2, 1, 1, True), (7, 16, 4, 4, 2, True), (33, 16, 3, 2, 1, False), (33, 24, 6, 8, 3, True)])
def test_sigmoid_grouped_topk_matches_transformers_deepseek_v3(path, T, E, top_k, n_group, topk_group, renorm,
                                                                request):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    request.getfixturevalue(path)
    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=renorm)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.3)
    router.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    hidden = torch.randn(T, 64)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden)
    w, ids, counts = route_sigmoid_grouped_topk(logits, top_k, bias=router.e_score_correction_bias, n_group=n_group,
                                                topk_group=topk_group, routed_scaling_factor=2.5, renormalize=renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, top_k)
    # transformers' top-k is unsorted: compare as id-sorted sets
    ids_s, perm = ids.long().sort(dim=-1)
    hf_s, hf_perm = hf_ids.sort(dim=-1)
    torch.testing.assert_close(ids_s, hf_s, rtol=0, atol=0)
    torch.testing.assert_close(w.gather(1, perm), hf_w.gather(1, hf_perm), rtol=1e-5, atol=1e-6)
    _check_counts(ids, counts, E)


def _grouped_reference_f64(logits, top_k, bias, n_group, topk_group, scale, renorm):
    """Plain per-token reading of the DeepSeek-V3 rule, in float64."""
    T, E = logits.shape
    s = torch.sigmoid(logits.double())
    b = s + bias.double()
    gsize = E // n_group
    ids = torch.empty(T, top_k, dtype=torch.long)
    for t in range(T):
        gscore = [sorted(b[t, g * gsize:(g + 1) * gsize].tolist())[-2:] for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -sum(gscore[g]))[:topk_group]
        allowed = [e for e in range(E) if e // gsize in groups]
        ids[t] = torch.tensor(sorted(allowed, key=lambda e: -b[t, e].item())[:top_k])
    w = s.gather(1, ids)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sigmoid_grouped_topk_vs_float64_rule(path, dtype, request):
    request.getfixturevalue(path)
    T, E, top_k, n_group, topk_group = 19, 32, 5, 4, 2
    logits = torch.randn(T, E).to(dtype)
    bias = torch.randn(E) * 0.2
    w, ids, counts = route_sigmoid_grouped_topk(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                                                routed_scaling_factor=1.7)
    ref_w, ref_ids = _grouped_reference_f64(logits, top_k, bias, n_group, topk_group, 1.7, True)
    b = torch.sigmoid(logits.float()) + bias
    ok = _untied_rows(b, top_k)
    torch.testing.assert_close(ids[ok].long().sort(-1)[0], ref_ids[ok].sort(-1)[0], rtol=0, atol=0)
    torch.testing.assert_close(w[ok].double(), ref_w[ok], rtol=1e-5, atol=1e-6)
    _check_counts(ids, counts, E)


def test_bias_steers_selection_not_weights(triton_kernels):
    T, E = 5, 8
    logits = torch.zeros(T, E)
    logits[:, 0] = 3.0  # expert 0 has the best score ...
    bias = torch.zeros(E)
    bias[5] = 10.0  # ... but expert 5's bias wins selection
    w, ids, _ = route_sigmoid_grouped_topk(logits, 1, bias=bias, renormalize=False)
    assert (ids == 5).all()
    torch.testing.assert_close(w, torch.full((T, 1), 0.5))  # sigmoid(0): the unbiased score
    ref = route_sigmoid_grouped_topk_native(logits, 1, bias=bias, renormalize=False)
    torch.testing.assert_close(w, ref[0])


def test_counts_accumulate_nothing_across_calls_and_empty_input(triton_kernels):
    logits = torch.randn(9, 8)
    c1 = route_softmax_topk(logits, 2)[2]
    c2 = route_softmax_topk(logits, 2)[2]
    torch.testing.assert_close(c1, c2, rtol=0, atol=0)
    assert int(c1.sum()) == 18
    w, ids, counts = route_softmax_topk(torch.randn(0, 8), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and int(counts.sum()) == 0

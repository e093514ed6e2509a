"""MoE routing: router logits -> (top-k weights fp32 [T, k], top-k expert ids int32 [T, k], expert counts int32 [E]).

Two routers, each a Triton kernel (one program per BLOCK_T tokens, the whole expert row in registers), a native
PyTorch reference written the way `transformers` does it, and a dispatching public function:

- ``route_softmax_topk`` (Qwen3-MoE): p = softmax(logits) in fp32, the k largest p, optionally divided by their sum
  (``norm_topk_prob``). transformers casts the weights back to the logits' dtype; areno keeps them in fp32 and lets
  the caller cast.
- ``route_sigmoid_grouped_topk`` (DeepSeek-V3 / Ling V3): s = sigmoid(logits); selection on b = s + bias, limited to
  the ``topk_group`` groups whose top-2 biased scores sum highest; weights are the *unbiased* s of the chosen experts,
  divided by their sum (+1e-20) when ``renormalize``, times ``routed_scaling_factor``.

Counts are the number of (token, slot) assignments per expert: the load counters a trainer uses for bias updates.
Both paths produce them without a host sync (atomic adds of integers in Triton, ``scatter_add_`` natively).
Top-k is k rounds of (row max, lowest index attaining it, knock it out), so ties go to the lower expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import use_triton

_MAX_EXPERTS = 1024  # one row of logits lives in registers


@triton.jit
def _topk_round(choice, offs_e, BLOCK_E: tl.constexpr):
    """Largest entry per row of ``choice`` [BT, BE], its lowest column index, and ``choice`` with it removed."""
    best = tl.max(choice, axis=1)
    idx = tl.min(tl.where(choice == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
    choice = tl.where(offs_e[None, :] == idx[:, None], float("-inf"), choice)
    return best, idx, choice


@triton.jit
def _store_routing(w, ids, w_ptr, ids_ptr, counts_ptr, offs_t, offs_k, mask_t, TOP_K: tl.constexpr):
    mask = mask_t[:, None] & (offs_k[None, :] < TOP_K)
    out = offs_t[:, None] * TOP_K + offs_k[None, :]
    tl.store(w_ptr + out, w, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.atomic_add(counts_ptr + ids, tl.full(ids.shape, 1, tl.int32), mask=mask)


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_t,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < T
    mask_e = offs_e < E
    x = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride_t + offs_e[None, :],
                mask=mask_t[:, None] & mask_e[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(mask_t[:, None], x, 0.0)  # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    choice = tl.where(mask_e[None, :], p, float("-inf"))
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best, idx, choice = _topk_round(choice, offs_e, BLOCK_E)
        w = tl.where(offs_k[None, :] == j, best[:, None], w)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    _store_routing(w, ids, w_ptr, ids_ptr, counts_ptr, offs_t, offs_k, mask_t, TOP_K)


@triton.jit
def _sigmoid_grouped_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_t, scale,
                                 TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                 RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_G)
    mask_t = offs_t < T
    mask_e = offs_e < E
    x = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride_t + offs_e[None, :],
                mask=mask_t[:, None] & mask_e[None, :], other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    biased = tl.where(mask_e[None, :], s + bias[None, :], float("-inf"))
    group_of = offs_e // (E // N_GROUP)
    # group score: sum of the two largest biased scores in the group
    gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        in_g = tl.where(group_of[None, :] == g, biased, float("-inf"))
        m1, _, in_g = _topk_round(in_g, offs_e, BLOCK_E)
        m2 = tl.max(in_g, axis=1)
        gscore = tl.where(offs_g[None, :] == g, (m1 + m2)[:, None], gscore)
    keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        _, gidx, gscore = _topk_round(gscore, offs_g, BLOCK_G)
        keep = keep | (group_of[None, :] == gidx[:, None])
    choice = tl.where(keep, biased, float("-inf"))
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        _, idx, choice = _topk_round(choice, offs_e, BLOCK_E)
        sj = tl.sum(tl.where(offs_e[None, :] == idx[:, None], s, 0.0), axis=1)
        w = tl.where(offs_k[None, :] == j, sj[:, None], w)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scale
    _store_routing(w, ids, w_ptr, ids_ptr, counts_ptr, offs_t, offs_k, mask_t, TOP_K)


def _check_logits(router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    assert router_logits.dim() == 2, f"router_logits must be [tokens, experts], got {tuple(router_logits.shape)}"
    assert router_logits.is_floating_point(), f"router_logits must be floating point, got {router_logits.dtype}"
    T, E = router_logits.shape
    assert 1 <= top_k <= E, f"top_k must be in [1, {E}], got {top_k}"
    return T, E


def _outputs(T: int, E: int, top_k: int, device):
    w = torch.empty(T, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=device)
    counts = torch.zeros(E, dtype=torch.int32, device=device)
    return w, ids, counts


def _block_t(E: int) -> int:
    return max(1, min(64, 4096 // triton.next_power_of_2(E)))


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E]: how many (token, slot) pairs each expert received; sync-free."""
    ids = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))


def route_softmax_topk_native(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True):
    """Qwen3-MoE's router, as transformers writes it, minus the final cast to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32), expert_counts(ids, router_logits.shape[-1])


def route_sigmoid_grouped_topk_native(router_logits, top_k, *, bias, n_group=1, topk_group=1,
                                      routed_scaling_factor=1.0, renormalize=True):
    """DeepSeek-V3's router, as transformers writes it (bias steers selection, not the weights)."""
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()
    biased = scores + bias.float()
    group_scores = biased.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()
    ids = torch.topk(biased.masked_fill(~expert_mask, float("-inf")), k=top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * routed_scaling_factor
    return w, ids.to(torch.int32), expert_counts(ids, E)


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True):
    """Softmax top-k routing (Qwen3-MoE). Returns (weights fp32 [T, k], ids int32 [T, k], counts int32 [E])."""
    T, E = _check_logits(router_logits, top_k)
    if not use_triton(router_logits, supported=E <= _MAX_EXPERTS):
        return route_softmax_topk_native(router_logits, top_k, renormalize=renormalize)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    w, ids, counts = _outputs(T, E, top_k, logits.device)
    if T == 0:
        return w, ids, counts
    block_e, block_t = triton.next_power_of_2(E), _block_t(E)
    _softmax_topk_kernel[(triton.cdiv(T, block_t),)](
        logits, w, ids, counts, T, E, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return w, ids, counts


def route_sigmoid_grouped_topk(router_logits: torch.Tensor, top_k: int, *, bias: torch.Tensor, n_group: int = 1,
                               topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True):
    """Sigmoid, bias-steered, group-limited top-k routing (DeepSeek-V3 / Ling V3). Same return triple."""
    T, E = _check_logits(router_logits, top_k)
    assert bias.shape == (E,), f"bias must be [{E}], got {tuple(bias.shape)}"
    assert n_group >= 1 and E % n_group == 0, f"n_group={n_group} must divide the {E} experts"
    assert E // n_group >= 2, f"each group needs at least 2 experts (group score is a top-2 sum), got {E // n_group}"
    assert 1 <= topk_group <= n_group, f"topk_group must be in [1, n_group={n_group}], got {topk_group}"
    assert top_k <= topk_group * (E // n_group), f"top_k={top_k} exceeds the experts in {topk_group} groups"
    kwargs = dict(bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize)
    if not use_triton(router_logits, bias, supported=E <= _MAX_EXPERTS and n_group <= 64):
        return route_sigmoid_grouped_topk_native(router_logits, top_k, **kwargs)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    w, ids, counts = _outputs(T, E, top_k, logits.device)
    if T == 0:
        return w, ids, counts
    block_e, block_t = triton.next_power_of_2(E), _block_t(E)
    _sigmoid_grouped_topk_kernel[(triton.cdiv(T, block_t),)](
        logits, bias.contiguous(), w, ids, counts, T, E, logits.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, RENORM=renormalize, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(n_group),
        num_warps=4)
    return w, ids, counts

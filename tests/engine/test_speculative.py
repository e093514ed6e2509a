"""verify_draft: exact speculative sampling against float64 references: greedy is the target's argmax chain, the
emitted tokens (first token and 2-token prefix) are distributed as the target's processed distribution under a bad
draft (chi-square over many seeds: temperature 1, top-k/top-p, penalties updated token by token), the residual,
edge cases (draft prob 0, K = 0, all accepted) and the log-probs the engine reports."""

import pytest
import torch

from areno.config.sampling import SamplingParams
from areno.engine.logit_adjust import LogitAdjuster, adjust_host
from areno.engine.sequence import Sequence, Status
from areno.engine.speculative import residual_probs, verify_draft
from areno.kernels.penalties import reset_token_state
from areno.kernels.sampler import sample, sampling_probs

V, EOS = 6, 5
PROMPT = [1, 3, 3]


def _oracle(logits, seq_tokens, opts, eos=EOS):
    """float64: the distribution the engine's plain sampling draws the next token of ``seq_tokens`` from."""
    x = logits.double().clone()
    out = seq_tokens[len(PROMPT):]
    for t, b in opts.logit_bias.items():
        x[t] += b
    if len(out) < opts.min_new_tokens:
        x[[eos, *opts.stop_token_ids]] = float("-inf")
    for t in set(seq_tokens):
        c = out.count(t)
        x[t] = x[t] / opts.repetition_penalty if x[t] > 0 else x[t] * opts.repetition_penalty
        x[t] -= opts.frequency_penalty * c + opts.presence_penalty * (c > 0)
    if opts.temperature <= 0:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    probs = torch.softmax(x / opts.temperature, 0)
    order = probs.argsort(descending=True)
    k = len(x) if opts.top_k <= 0 else opts.top_k
    cand = order[:k]
    cand = cand[probs[cand] >= opts.min_p * probs.max()]
    if opts.top_p < 1:
        cum = (probs[cand] / probs[cand].sum()).cumsum(0)
        cand = cand[: int((cum < opts.top_p).sum()) + 1]
    keep = torch.zeros(len(x), dtype=torch.double)
    keep[cand] = probs[cand]
    return keep / keep.sum()


def _chi2_pvalue(counts, probs):
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (cells with probability 0 must be empty)."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, f"tokens outside the target's support: {counts} vs {probs}"
    on = probs > 0
    exp = probs[on] * n
    assert exp.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((counts[on] - exp) ** 2 / exp).sum()
    df = int(on.sum()) - 1
    assert df >= 1, "a one-token distribution: nothing to test"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


def _pool(counts, probs, n):
    """Cells expected fewer than 5 times pooled into one (itself merged into the smallest other cell if still rare)."""
    big = probs * n >= 5
    counts, probs = torch.cat([counts[big], counts[~big].sum()[None]]), torch.cat([probs[big], probs[~big].sum()[None]])
    if probs[-1] * n < 5:
        j = int(probs[:-1].argmin())
        counts[j] += counts[-1]
        probs[j] += probs[-1]
        counts, probs = counts[:-1], probs[:-1]
    return counts, probs


def _tables(seed=0):
    """A Markov 'target model' (logits by the last token) and a deliberately bad draft: different logits, zero
    probability on two tokens the target likes."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    q = 0.5 * torch.softmax(target, 1) + 0.5 * torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 2, 1)
    q[:, [0, 2]] = 0.0
    return target.float(), (q / q.sum(1, keepdim=True)).float()


def _run(opts, n, K, steps=2, seed=0, draft_from_target=False, device="cpu", adjuster=None):
    """``steps`` speculative steps of ``n`` sequences (seeds as the engine draws them from a request's seed); the
    sequences and the first step's accepted counts."""
    target, q = _tables()
    g = torch.Generator().manual_seed(seed + 1)
    seqs = [Sequence(PROMPT, opts, seed=(seed * 1_000_003 + i) % 2**62) for i in range(n)]
    for s in seqs:
        s.status = Status.RUNNING
    adjuster = adjuster if adjuster is not None else LogitAdjuster(n, V, device, eos_token_ids=[EOS])
    accepted = None
    for _ in range(steps):
        plan = adjuster.plan(seqs)
        host = None
        if plan is not None:
            adjuster.fill(plan)
            host = {k: v.to(device) for k, v in adjust_host(plan, n, plan.width).items()}
        last = torch.tensor([s.tokens[-1] for s in seqs])
        drafts, dprobs, ctx = [], [], [last]
        for _ in range(K):
            dist = torch.softmax(target[ctx[-1]], 1) if draft_from_target else q[ctx[-1]]
            d = torch.multinomial(dist, 1, generator=g)[:, 0]
            drafts.append(d)
            dprobs.append(dist)
            ctx.append(d)
        logits = target[torch.stack(ctx, 1)]  # [n, K+1, V]: position i follows draft token i-1
        ver = verify_draft(logits.to(device), (torch.stack(drafts, 1) if K else torch.zeros(n, 0, dtype=torch.long)).to(
                           device), (torch.stack(dprobs, 1) if K else torch.zeros(n, 0, V)).to(device), K,
                           temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
                           seeds=[s.seed for s in seqs], offsets=[len(s) for s in seqs], adjust=host,
                           token_state=adjuster.token_state)  # fmt: skip
        for s, toks in zip(seqs, ver.lists()[0]):
            s.tokens.extend(toks)
        accepted = ver.accepted.cpu() if accepted is None else accepted
    return seqs, accepted


CASES = {
    "t1": SamplingParams(temperature=1.0),
    "topk_topp": SamplingParams(temperature=0.8, top_k=4, top_p=0.85),
    # EOS banned at the first token only (min_tokens), the second penalised by the first
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                                logit_bias={4: -1.0}, min_new_tokens=1, min_p=0.02),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_distribution(case):
    opts = CASES[case]
    n = 6000
    seqs, accepted = _run(opts, n, K=3, steps=2)
    first = torch.tensor([s.tokens[len(PROMPT)] for s in seqs])
    second = torch.tensor([s.tokens[len(PROMPT) + 1] for s in seqs])
    target, _ = _tables()
    p0 = _oracle(target[PROMPT[-1]], PROMPT, opts)
    assert _chi2_pvalue(torch.bincount(first, minlength=V).double(), p0) > 1e-3
    # the 2-token prefix: P(x0) P(x1 | x0), the second distribution penalised by x0
    joint = torch.stack([p0[a] * _oracle(target[a], PROMPT + [a], opts) for a in range(V)]).reshape(-1)
    pairs = torch.bincount(first * V + second, minlength=V * V).double()
    assert pairs[joint == 0].sum() == 0
    assert _chi2_pvalue(*_pool(pairs, joint, n)) > 1e-3
    # the draft is bad but not useless: rejections, acceptances and all-accepted bonus tokens all occur
    assert (accepted == 0).float().mean() > 0.1 and (accepted == 3).float().mean() > 0.02


@pytest.mark.parametrize("good_draft", [False, True])
def test_greedy_is_the_argmax_chain(good_draft):
    opts = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.7)
    seqs, accepted = _run(opts, 40, K=3, steps=3, draft_from_target=good_draft)
    if good_draft:  # some proposals agree with the argmax
        assert accepted.sum() > 0
    target, _ = _tables()
    chain = list(PROMPT)
    for _ in range(max(len(s.tokens) for s in seqs) - len(PROMPT)):
        chain.append(int(_oracle(target[chain[-1]], chain, opts).argmax()))
    for s in seqs:
        assert s.tokens == chain[: len(s.tokens)]
        assert len(s.tokens) >= len(PROMPT) + 3


def test_accepted_tokens_are_counted_for_the_penalties():
    opts = CASES["penalties"]
    adjuster = LogitAdjuster(50, V, "cpu", eos_token_ids=[EOS])
    seqs, _ = _run(opts, 50, K=3, steps=2, adjuster=adjuster)
    fresh = LogitAdjuster(50, V, "cpu")
    for i, s in enumerate(seqs):  # slot i held by sequence i since its first step
        reset_token_state(fresh.counts(), i, s.tokens[: s.prompt_len], s.tokens[s.prompt_len :])
    assert torch.equal(adjuster.token_state, fresh.token_state)


def test_greedy_accepts_exactly_the_agreeing_prefix():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 9, generator=g)
    best = logits.argmax(-1)
    draft = best[:, :4].clone()
    draft[0, 2] = (draft[0, 2] + 1) % 9  # row 0 disagrees at 2; row 1 agrees everywhere; row 2 uses K = 1
    q = torch.full((3, 4, 9), 1 / 9)
    ver = verify_draft(logits, draft, q, [4, 4, 1], temperature=0.0, seeds=7, offsets=10)
    assert ver.accepted.tolist() == [2, 4, 1]
    toks, lps = ver.lists()
    assert toks == [best[0, :3].tolist(), best[1].tolist(), best[2, :2].tolist()]
    ref = torch.log_softmax(logits, -1)  # greedy rows report the T = 1 log-probs, as the engine does
    for b, row in enumerate(toks):
        assert lps[b] == pytest.approx([ref[b, i, t].item() for i, t in enumerate(row)], abs=1e-5)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6, top_k=3), dict(temperature=1.3, top_p=0.7),
                                dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.1), dict(temperature=0.0, top_k=2)])
def test_sampling_probs_is_the_float64_processed_distribution(kw):
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(2)) * 2
    probs = sampling_probs(logits, **kw)
    for row, got in zip(logits, probs):
        assert torch.allclose(got.double(), _oracle(row, PROMPT, SamplingParams(**kw)), atol=1e-6)


def test_residual_in_float64():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 7, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(4, 7, generator=g, dtype=torch.float64), -1)
    q[0, :3] = 0.0  # draft prob 0 where the target has mass
    q[0] /= q[0].sum()
    r = residual_probs(p, q)
    ref = (p - q).clamp(min=0)
    assert torch.allclose(r, ref / ref.sum(-1, keepdim=True), atol=1e-15, rtol=0)
    # accept-or-residual gives back p exactly: q min(1, p/q) + (1 - sum min(p, q)) r = p
    emitted = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum(-1, keepdim=True)) * r
    assert torch.allclose(emitted, p, atol=1e-14, rtol=0)
    assert torch.equal(residual_probs(p, p), p)  # an empty residual falls back to p


def test_k0_and_all_accepted_match_plain_sampling():
    g = torch.Generator().manual_seed(9)
    B, K = 64, 3
    logits = torch.randn(B, K + 1, 11, generator=g)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    kw = dict(temperature=0.7, top_k=6, top_p=0.9)
    # K = 0: exactly the engine's plain sample at the same seed and offset
    ver = verify_draft(logits[:, :1], torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0, 11), 0, seeds=seeds,
                       offsets=20, **kw)  # fmt: skip
    plain, plain_lp = sample(logits[:, 0], seeds=seeds, offsets=20, **kw)
    assert torch.equal(ver.tokens[:, 0], plain) and torch.allclose(ver.logprobs[:, 0], plain_lp, atol=1e-5)
    again = verify_draft(logits[:, :1], torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0, 11), 0, seeds=seeds + 1,
                         offsets=20, **kw)  # fmt: skip
    assert not torch.equal(again.tokens, ver.tokens)  # another seed, other draws
    # a draft that is the target's own processed distribution, drawn with q = p: all accepted, then the bonus token
    # is the plain sample at offset + K
    p = sampling_probs(logits.view(-1, 11), temperature=0.7, top_k=6, top_p=0.9).view(B, K + 1, 11)
    draft = torch.multinomial(p[:, :K].reshape(-1, 11), 1, generator=g).view(B, K)
    ver = verify_draft(logits, draft, p[:, :K], K, seeds=seeds, offsets=20, **kw)
    assert ver.accepted.tolist() == [K] * B
    assert torch.equal(ver.tokens[:, :K], draft)
    assert torch.equal(ver.tokens[:, K], sample(logits[:, K], seeds=seeds, offsets=20 + K, **kw)[0])


def test_mixed_batch_equals_each_sequence_alone():
    """Different K and settings per sequence in one batch: each row's result is the one it gets alone."""
    g = torch.Generator().manual_seed(13)
    B, K, W = 4, 3, 10
    logits = torch.randn(B, K + 1, W, generator=g) * 2
    q = torch.softmax(torch.randn(B, K, W, generator=g), -1)
    draft = torch.multinomial(q.view(-1, W), 1, generator=g).view(B, K)
    per = dict(num_draft=[3, 0, 2, 1], temperature=[1.0, 0.0, 0.7, 1.2], top_k=[0, 3, 4, 0], top_p=[1.0, 1.0, 0.8, 0.9],
               seeds=[11, 12, 13, 14], offsets=[5, 9, 7, 30])  # fmt: skip
    batch = verify_draft(logits, draft, q, **per)
    for b in range(B):
        one = verify_draft(logits[b : b + 1], draft[b : b + 1], q[b : b + 1], **{k: v[b] for k, v in per.items()})
        assert one.lists() == tuple(x[b : b + 1] for x in batch.lists())


def test_draft_token_outside_draft_support_is_accepted_where_target_has_mass():
    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    ver = verify_draft(logits, torch.tensor([[1]]), q, 1, temperature=1.0, seeds=1, offsets=3)
    assert ver.accepted.tolist() == [1]
    # a proposal the target gives zero probability (top-k 1 keeps token 0 only) is always rejected, then token 0
    ver = verify_draft(logits, torch.tensor([[1]]), q * 0 + torch.tensor([0.0, 1.0, 0.0]), 1, temperature=1.0,
                       top_k=1, seeds=1, offsets=3)  # fmt: skip
    assert ver.accepted.tolist() == [0] and ver.tokens[0, 0].item() == 0


def test_bad_input_is_refused():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="num_draft"):
        verify_draft(logits, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, 5), [3, 1], temperature=1.0,
                     seeds=0, offsets=0)  # fmt: skip
    with pytest.raises(ValueError, match="draft_probs"):
        verify_draft(logits, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 5), 2, temperature=1.0, seeds=0,
                     offsets=0)  # fmt: skip


def test_triton_kernels_give_the_native_result(monkeypatch):
    """The Triton penalty, bias and sampler kernels (interpreted here) inside the verify step: the same tokens."""
    opts = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.4,
                          logit_bias={4: -0.5}, min_new_tokens=1, min_p=0.01)  # fmt: skip
    out = {}
    for kernels in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", kernels)
        seqs, accepted = _run(opts, 24, K=3, steps=2, seed=4)
        out[kernels] = ([s.tokens for s in seqs], accepted.tolist())
    assert out["triton"] == out["native"]


@pytest.mark.gpu
def test_verify_on_cuda_matches_cpu_greedy():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 4, 1000, generator=g)
    draft = logits[:, :3].argmax(-1)
    draft[::2, 1] = 0
    q = torch.softmax(torch.randn(8, 3, 1000, generator=g), -1)
    cpu = verify_draft(logits, draft, q, 3, temperature=0.0, seeds=1, offsets=5)
    gpu = verify_draft(logits.cuda(), draft.cuda(), q.cuda(), 3, temperature=0.0, seeds=1, offsets=5)
    assert torch.equal(gpu.tokens.cpu(), cpu.tokens) and torch.equal(gpu.accepted.cpu(), cpu.accepted)


@pytest.mark.gpu
def test_distribution_on_cuda():
    """The Triton kernels on the GPU inside the verify step: the first token's chi-square, top-k/top-p, penalties."""
    opts = SamplingParams(temperature=1.5, top_k=4, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.2)
    seqs, _ = _run(opts, 20000, K=3, steps=1, device="cuda")
    first = torch.tensor([s.tokens[len(PROMPT)] for s in seqs])
    p0 = _oracle(_tables()[0][PROMPT[-1]], PROMPT, opts)
    assert _chi2_pvalue(torch.bincount(first, minlength=V).double(), p0) > 1e-3

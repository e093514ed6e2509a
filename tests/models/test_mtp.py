"""The MTP layers run as a draft (``areno.models.mtp``) against a float64 reference written from the Hub tensors:
Qwen3.5 (dense and MoE), DeepSeek-V3 and Ling 3. The reference normalises the embedding of the next token and the
previous hidden state with the kept norm weights, concatenates them (the embedding first), projects, runs the
decoder block over the whole prefix without a cache, applies the final norm and the head; the engine's drafts (paged
MTP K/V, fp32, chained decode steps) equal the reference's argmax chain; the kept tensors still save bit-identical."""

import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, save_model
from areno.models.base import training_metadata
from areno.models.mtp import build_mtp_draft, mtp_loss
from areno.testing import make_tiny_checkpoint

# family: (Hub prefix of MTP layer 0, its parts: enorm, hnorm, proj, final norm; zero-centred norms; own head)
FAMILIES = {
    "qwen3_5": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), True, False),
    "qwen3_5_moe": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), True, False),
    "deepseek_v3": ("model.layers.{L}.", ("enorm", "hnorm", "eh_proj", "shared_head.norm"), False, True),
    "bailing_hybrid": ("model.layers.{L}.", ("enorm", "hnorm", "eh_proj", "final_layernorm"), False, False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    return request.param, path


def _rms(x, w, eps, zero_centred):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1.0 + w) if zero_centred else w)


class Reference:
    """The float64 MTP step 0, recomputed over the whole prefix for each chained token (no cache)."""

    def __init__(self, model):
        self.model, self.draft = model, build_mtp_draft(model)
        name, (en, hn, proj, fn), self.zc, own = FAMILIES[model.config.model_type.removesuffix("_text")]
        p = name.format(L=model.config.num_layers)
        dtype = model.embed_tokens.weight.dtype  # the kept tensors stay in the checkpoint's dtype
        kept = {n: getattr(model.mtp, f"t{j}").to(dtype) for j, n in enumerate(model.mtp.names)}
        self.en, self.hn, self.proj, self.fn = (kept[f"{p}{n}.weight"] for n in (en, hn, proj, fn))
        self.embed = kept[f"{p}embed_tokens.weight"] if own else model.embed_tokens.weight
        self.head = kept[f"{p}shared_head.head.weight"] if own else model.lm_head_weight
        self.chain_normed = not p.startswith("model.layers.")
        self.eps = model.config.rms_norm_eps

    def step(self, hidden, next_ids):
        """Outputs (normed) and chained hidden states at every position of ``hidden [T, H]``, ``next_ids [T]``."""
        e = _rms(self.embed[next_ids], self.en, self.eps, self.zc)
        z = torch.cat([e, _rms(hidden, self.hn, self.eps, self.zc)], dim=-1) @ self.proj.T  # the embedding first
        pos = torch.arange(len(next_ids))
        h, res = self.draft.blocks[0](z, None, pos, self.model.rope, training_metadata(next_ids))
        out = _rms(h + res, self.fn, self.eps, self.zc)
        return out, (out if self.chain_normed else h + res)

    def chain(self, ids: list[int], k: int) -> list[int]:
        """Greedy drafts after ``ids`` (prompt + first output token): the target's hidden states, step 0 over every
        position, then each drafted token appended as a new position of the MTP's own sequence."""
        with torch.no_grad():
            t = torch.tensor(ids)
            hidden = self.model(t, torch.arange(len(ids)))[:-1]
            nxt, out = t[1:], []
            for _ in range(k):
                o, g = self.step(hidden, nxt)
                out.append(int((o[-1] @ self.head.T).argmax()))
                hidden, nxt = torch.cat([hidden, g[-1:]]), torch.cat([nxt, torch.tensor(out[-1:])])
        return out


def test_draft_forward_equals_the_float64_reference(family):
    name, path = family
    model = load_model(path, dtype=torch.float64, device="cpu")
    ref = Reference(model)
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, torch.arange(11))[:-1]
        out, chain = ref.draft(model, 0, hidden, ids[1:], torch.arange(10), training_metadata(ids[1:]))
        want_out, want_chain = ref.step(hidden, ids[1:])
    tol = 1e-5 if ref.zc else 1e-10  # Qwen3.5's zero-centred norms compute in fp32 (as transformers does)
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(chain, want_chain, rtol=tol, atol=tol)
    assert ref.draft.num_layers == 1


def test_engine_drafts_equal_the_reference_chain(family):
    """After the prefill step the engine holds K = 3 greedy drafts made through the paged MTP cache (fp32): the
    float64 reference's argmax chain."""
    name, path = family
    model = load_model(path, dtype=torch.float32, device="cpu")
    e = Engine(model, None, EngineConfig(block_size=4, max_running=4, speculative_tokens=3), eos_token_ids=[])
    prompt = [5, 9, 13, 200, 7, 8, 9, 31, 2]
    (seq,) = e.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    e.step()
    drafted = e.spec.drafts[seq.seq_id].tokens
    ref = Reference(load_model(path, dtype=torch.float64, device="cpu"))
    assert drafted == ref.chain(seq.tokens, 3)


def test_kept_tensors_still_save_bit_identical_after_drafting(family, tmp_path):
    name, path = family
    model = load_model(path, dtype=torch.float32, device="cpu")
    draft = build_mtp_draft(model)
    draft.store_kept(model)  # the draft's copies written back: the same values
    out = save_model(model, tmp_path / "out")
    from safetensors.torch import load_file

    a, b = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    mtp = [k for k in a if k in set(model.mtp.names)]
    assert mtp and all(torch.equal(a[k], b[k]) for k in mtp)


def test_mtp_loss_is_the_teacher_forced_cross_entropy_and_trains_the_draft_only(family):
    """``mtp_loss`` over two packed rows (labels: the scored tokens t + 2, prompt of 3) equals the float64 reference's
    summed cross-entropy and argmax hits per row; its gradient reaches the draft and never the target."""
    name, path = family
    model = load_model(path, dtype=torch.float32, device="cpu")  # training runs the fp32 kernels (no fp64 there)
    draft, ref = build_mtp_draft(model, trainable=True), Reference(load_model(path, dtype=torch.float64, device="cpu"))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (9, 6)]
    ids, positions = torch.cat(rows), torch.cat([torch.arange(len(r)) for r in rows])
    cu = torch.tensor([0, 9, 15], dtype=torch.int32)
    targets = torch.full_like(ids, -100)
    for r, start in zip(rows, (0, 9)):
        targets[start + 2 : start + len(r) - 1] = r[3:]  # position P - 1 + k scores response token k
    with torch.no_grad():
        hidden = model(ids, positions, cu_seqlens=cu, max_seqlen=9).requires_grad_(True)
    ce, correct, count = mtp_loss(model, draft, hidden, ids, positions, cu, targets)
    want = torch.zeros(3, dtype=torch.float64)
    for r, start in zip(rows, (0, 9)):
        with torch.no_grad():
            out, _ = ref.step(ref.model(r, torch.arange(len(r)))[:-1], r[1:])
        logits, labels = out @ ref.head.T, targets[start + 1 : start + len(r)]  # position t: label targets[t + 1]
        ok = labels != -100
        want += torch.stack([torch.nn.functional.cross_entropy(logits[ok], labels[ok], reduction="sum"),
                             (logits[ok].argmax(-1) == labels[ok]).sum(), ok.sum()]).double()
    torch.testing.assert_close(ce.detach().double(), want[0], rtol=1e-5, atol=1e-4)
    # the labels: each row's response tokens but its first (6 and 3)
    assert (int(correct), int(count)) == (int(want[1]), int(want[2])) == (int(want[1]), 6 + 3)
    ce.backward()
    assert hidden.grad is None and all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in draft.parameters() if p.requires_grad)
    assert draft.proj[0].weight.grad.abs().sum() > 0

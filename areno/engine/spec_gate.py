"""The gate of speculative decoding (``--speculative-disable-by-batch-size``, vLLM's ``disable_by_batch_size``): a
step speculates only while at most N sequences decode in it; ``auto`` makes N follow the accept length.

Why: a decode step of B sequences reads every weight once and does 2 x (active parameters) FLOPs per token. While
B is small the step is memory-bound and verifying K + 1 positions per sequence costs about what one position does,
so the accepted drafts are nearly free tokens; once B (K + 1) tokens pass the device's ridge point the step is
compute-bound and the verify costs up to (K + 1)x a plain step, which the accepted drafts pay for only while enough
of them are accepted (verl measured a 50% loss where they were not). Above N a step is a plain decode step: no drafts
verified, one token per sequence, decode-mode attention and the runner's own sampling when nothing else shares the
step. The MTP layer's paged K/V must still cover every position (its catch-up, step 0 of the draft, one layer):
``spec_decode`` defers it for gated decode steps and runs it in one pass when the gate lifts (see there), so drafting
resumes exactly when the batch shrinks again. Drafts are made at the end of a step only when the next step
speculates: when the sequences that will decode in it (every running sequence with its prompt computed) are at most N.

``auto`` (``Gate``): with T = ridge x (weight bytes a step reads) / (FLOPs per token) the tokens at which a step turns
compute-bound (ridge = peak dense bf16 FLOP/s / memory bandwidth of the device, ``areno.platform.roofline``), a
plain step of B sequences costs max(T, B) token-times and a speculative one max(T, B (K + 1)) plus K draft steps of
mu max(T, B) each (mu: a draft step's FLOPs over the target's, its MTP layer and the head it uses). It pays while the
accept length a (tokens emitted per sequence and verify step) is at least their ratio, which holds for
B <= N(a) = floor(T (a - K mu) / (K + 1)) (0 once a < 1 + K mu: speculation loses at every batch). A hybrid's
decode row also reads and writes its recurrent-state slot, sigma = 2 x (slot bytes) x ridge / (FLOPs a token)
token-times, and a verify row reads it once (the verify writes no state) and its rollback's replay of the accepted
tokens reads and writes it once more (``spec_graphs.roll_back``), 3/2 sigma whatever the drafts' fate: a plain step
costs max(T + B sigma, B), a speculative one max(T + 3/2 B sigma, B (K + 1)) + K mu max(T, B), and N(a) is the
largest B where a x plain(B) >= speculative(B) (the batches that pay are all those up to it). With the 9B bench
shape's fp32 states (100 MB a row) a plain step stays memory-bound at any batch, so N at a high accept length is
unbounded but for the stash's cap (``spec_decode.stash_cap``), and a low one still gates it. The engine
reads a as the running accept length since its last ``take_stats`` (a rollout's window; a server's, idle to idle),
started from an optimistic prior of ``PRIOR_ROWS`` rows at K + 1, so a rollout that starts at a batch above N(K + 1)
stays plain, and one that starts below it learns its drafts' acceptance within its first steps. A step that also
prefills P prompt tokens (``Gate.speculates``) costs max(T, B (K + 1) + P) against max(T, B + P): its verify rows
cost their full compute once the prompt chunk fills the step, which the B (a - 1) tokens they add pay for only at
what those tokens would cost later, max(T, F) / F each, F the sequences decoding once the prompts are in (running
and waiting): a rollout's admission of 256 prompts runs plain, a server's new request beside a few streams
speculates. The rule is a
function of the tokens (no timings), so runs and resumes stay exact. Weight bytes: every parameter the target's
forward reads, in its dtype (embedding rows are gathered, not read whole: the table counts only as a tied LM head);
FLOPs: 2 per parameter and token, a routed expert's weighted by top-k / experts (the experts a token runs). K/V
reads (a function of the context, the same for a plain and a verify row) and attention FLOPs are left out (they
grow the memory side, so speculation pays a little beyond N), and so
are a small batch's fixed costs (kernel launches, host work), so at one or two sequences the gate speculates at
accept lengths a little below the true break-even. On a device without a known roofline (the CPU, other GPUs)
``auto`` is the fixed ``AUTO_FALLBACK``. An integer N is a fixed gate.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from areno.platform.roofline import Roofline, device_roofline

log = logging.getLogger("areno.engine")

AUTO_FALLBACK = 32  # auto's N on a device without a known roofline
PRIOR_ROWS = 8  # auto: verify rows' worth of the prior accept length K + 1 the running one starts from
MOST = 1 << 20  # auto: the largest N (a hybrid's at a high accept length can be unbounded: the stash caps it)


def decode_counts(model) -> tuple[float, float]:
    """(bytes of weights one decode step of ``model`` reads, FLOPs per token of its forward); MTP layers excluded."""
    head = model.lm_head_weight
    embed = getattr(getattr(model, "embed_tokens", None), "weight", None)
    expert_share = {}
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if getattr(m, "has_router", False) and experts is not None and getattr(m, "num_experts", 0):
            for p in experts.parameters():
                expert_share[id(p)] = m.top_k / m.num_experts
    nbytes = flops = 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or (p is embed and p is not head):
            continue
        nbytes += p.numel() * p.element_size()
        flops += 2.0 * p.numel() * expert_share.get(id(p), 1.0)
    return nbytes, flops


def draft_flops(model) -> float:
    """FLOPs a token of one MTP draft step (one MTP layer and the head it uses: its own, else the target's), as
    ``decode_counts`` counts them (a routed expert's weighted by top-k / experts); 0 without MTP layers."""
    layers = getattr(model, "num_mtp_layers", 0)
    if not layers:
        return 0.0
    share = next((m.top_k / m.num_experts for m in model.modules()
                  if getattr(m, "has_router", False) and getattr(m, "num_experts", 0)), 1.0)  # fmt: skip
    flops, own_head = 0.0, False
    for j, name in enumerate(model.mtp.names):
        if "embed_tokens" in name:  # a layer's own embedding: rows gathered
            continue
        own_head |= name.endswith("head.weight")
        flops += 2.0 * getattr(model.mtp, f"t{j}").numel() * (share if ".experts." in name else 1.0)
    head = 0.0 if own_head else 2.0 * model.lm_head_weight.numel()
    return flops / layers + head


@dataclass(frozen=True)
class Gate:
    """The largest batch that speculates, as a function of the running accept length (``limit``): a fixed N, or
    ``auto``'s N(a) on a known roofline (module docstring)."""

    k: int
    fixed: int | None = None  # a fixed N (also auto on a device without a roofline); None: auto's rule
    tokens: float = 0.0  # auto: T, the tokens at which a step turns compute-bound
    draft: float = 0.0  # auto: mu, a draft step's FLOPs over the target's a token
    cap: int | None = None  # auto: the most rows the hybrids' rollback stash holds (``spec_decode.spec_budget``)
    state: float = 0.0  # auto: sigma, a plain decode row's recurrent-state traffic in token-times (hybrids; else 0)

    def plain(self, b: float, prefill: float = 0.0) -> float:
        """Token-times of a plain step of ``b`` decoding sequences and ``prefill`` prompt tokens: max(T + b sigma,
        b + P) (weights and each row's state slot read and written, against the FLOPs)."""
        return max(self.tokens + b * self.state, b + prefill)

    def speculative(self, b: float, prefill: float = 0.0) -> float:
        """Token-times of the same step verifying K drafts a sequence, with its K draft steps: max(T + 3/2 b sigma,
        b (K + 1) + P) + K mu max(T, b) (a verify row reads its state once, the rollback's replay of its accepted
        tokens reads and writes it once)."""
        return max(self.tokens + 1.5 * b * self.state, b * (self.k + 1) + prefill) + self.k * self.draft * max(
            self.tokens, b)

    def at(self, accept: float) -> int:
        """N at accept length ``accept``: the largest batch at which ``accept`` tokens a verify row pay for its
        step, accept x plain(B) >= speculative(B) (those that pay are always the batches up to one), capped."""
        if self.fixed is not None:
            return self.fixed
        if not self.state:  # the closed form: B (K + 1) <= T (a - K mu)
            pays = accept - self.k * self.draft
            n = int(self.tokens * pays // (self.k + 1)) if pays >= 1.0 else 0
        else:
            n = _last(lambda b: accept * self.plain(b) >= self.speculative(b))
        return n if self.cap is None else min(n, self.cap)

    def accept(self, emitted: int = 0, rows: int = 0) -> float:
        """The running accept length of ``emitted`` tokens over ``rows`` verified rows (the window's counts), from
        the prior of ``PRIOR_ROWS`` rows at K + 1."""
        return (emitted + PRIOR_ROWS * (self.k + 1)) / (rows + PRIOR_ROWS)

    def limit(self, emitted: int = 0, rows: int = 0) -> int:
        """N for ``emitted`` tokens over ``rows`` verified rows (the window's counts; none yet: the prior alone)."""
        return self.at(self.accept(emitted, rows))

    def speculates(self, decoding: int, prefill: int = 0, future: int = 0, emitted: int = 0, rows: int = 0) -> bool:
        """Whether a step of ``decoding`` sequences decoding and ``prefill`` prompt tokens speculates, at the window's
        counts. A fixed N (vLLM's rule) and a step without prefill: ``decoding <= limit``. ``auto`` with prefill:
        that step costs ``plain(B, P)`` token-times plain and ``speculative(B, P)`` speculating (without states
        max(T, B + P) and max(T, B (K + 1) + P) + K mu max(T, B)); the B (a - 1) tokens the drafts add are worth
        what a token costs in the steps after it, plain(F) / F with F = max(``future``, B) the sequences that will
        decode once the prompts are in (running and waiting): a prompt chunk that fills the step makes its verify
        rows cost their full compute, which pays only where the decode that follows is memory-bound (few sequences;
        a server's new request beside a few streams), not in a rollout's admission of 256 prompts."""
        if self.fixed is not None or not prefill or not decoding or decoding > self.most:  # most: stash, graphs
            return decoding <= self.limit(emitted, rows)
        a, b, f = self.accept(emitted, rows), decoding, max(future, decoding)
        extra = self.speculative(b, prefill) - self.plain(b, prefill)
        return extra <= b * (a - 1.0) * self.plain(f) / f

    @functools.cached_property
    def most(self) -> int:
        """The largest N it can take (every draft accepted): the verify's stash and graphs are sized for it."""
        return self.at(self.k + 1)

    @functools.cached_property
    def least(self) -> int:
        """The smallest N it can take (no draft accepted): gated steps' graphs cover every batch above it."""
        return self.at(1.0)


def _last(pays, most: int = MOST) -> int:
    """The largest batch in [0, ``most``] where ``pays`` holds, those where it holds being the ones up to it."""
    if not pays(1):
        return 0
    lo, hi = 1, most
    if pays(hi):
        return hi
    while hi - lo > 1:  # pays(lo), not pays(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return lo


def auto_gate(model, k: int, roof: Roofline | None, slot_bytes: int = 0) -> tuple[Gate, str]:
    """``auto``'s gate for ``model`` with K = ``k`` draft tokens on a device of roofline ``roof`` (None: not known),
    and how it was chosen (for the log). ``slot_bytes``: a hybrid's recurrent-state slot (one sequence's states
    over its recurrent layers, ``RecurrentStates.bytes_per_slot``), read and written by each decode row."""
    if roof is None:
        return Gate(k, AUTO_FALLBACK), f"{AUTO_FALLBACK}, the fixed value for a device without a known roofline"
    nbytes, flops = decode_counts(model)
    gate = Gate(k, None, roof.ridge * nbytes / flops, draft_flops(model) / flops, state=2 * slot_bytes * roof.ridge
                / flops)  # fmt: skip
    rule = "T (a - K mu) / (K + 1)" if not slot_bytes else "the largest B with a plain(B) >= speculative(B)"
    states = f"; each row's states {2 * slot_bytes / 1e6:.1f} MB = sigma {gate.state:.2f} token-times" if slot_bytes \
        else ""
    return gate, (f"{roof.name}: ridge {roof.ridge:.0f} FLOP/byte x {nbytes / 1e9:.2f} GB of weights / "
                  f"{flops / 1e9:.2f} GFLOP a token = T {gate.tokens:.0f} tokens a step{states}; a draft step "
                  f"{gate.draft:.3f} of the target's FLOPs: N = {rule} = {gate.most} at accept length a = {k + 1}, "
                  f"{gate.at((k + 3) / 2)} at a = {(k + 3) / 2:g}, {gate.at(1.5)} at a = 1.5")


def resolve_gate(setting, model, k: int, device, slot_bytes: int = 0) -> Gate | None:
    """The engine's gate for its setting ("auto" or N >= 0), None: never gated; logged. ``slot_bytes``: a hybrid's
    recurrent-state slot (``auto_gate``)."""
    if setting == "auto":
        gate, why = auto_gate(model, k, device_roofline(device), slot_bytes)
        log.info("speculative decoding: auto gate, speculating while the batch is at most N (%s)", why)
        return gate
    if not setting:
        log.info("speculative decoding: every step speculates (--speculative-disable-by-batch-size off)")
        return None
    log.info("speculative decoding: speculating while at most %d sequences decode in a step", setting)
    return Gate(k, int(setting))

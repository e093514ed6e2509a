"""MTP speculative decoding in bench/rollout.py (``--speculative-tokens K``): the same workload with and without
speculation on a random-weight checkpoint of an MTP family, side by side (tok/s, speed-up, mean accept length).

    python bench/rollout.py --speculative-tokens 2 --workloads R3,R2 --mtp-family qwen3_5 --mtp-train-steps 300 \
        --mtp-fit-rounds 3 --spec-greedy
    python bench/rollout.py --speculative-tokens 2 --workloads R3 --mtp-family bailing_hybrid --mtp-train-steps 300
    python bench/rollout.py --speculative-tokens 2 --workloads R1 --spec-gate auto,off --mtp-train-steps 300
    python bench/rollout.py --speculative-tokens 2 --spec-batch-sweep --mtp-train-steps 300   # the crossover table
    python bench/rollout.py --speculative-tokens 2 --smoke                          # CPU: checks the script

Shapes (random bf16 weights, made once under the bench cache): ``qwen3_5`` a Qwen3.5-9B shape (32 layers, 3 gated
DeltaNet : 1 gated attention, hidden 4096, one MTP layer); ``bailing_hybrid`` a Ling-3-Flash-width shape (hidden
4096, MLA + KDA, 256 experts of 1024, top 8, one MTP layer) cut to 8 decoder layers so it fits one H200 in bf16.
Random MTP layers never agree with the model, so ``--mtp-train-steps N`` first trains the MTP layer for N Adam
steps on the model's own greedy continuations of the very prompts the bench then times (teacher forcing: step 0 of
the draft predicts token t + 2 from the target's hidden state at t and token t + 1). A random model's outputs have
no structure a draft could learn in general (the smoke model on the CPU, fitted on 8 prompts' continuations: greedy
acceptance 2.8 on those prompts, 1.25 on fresh ones), so this stands in for a real model's MTP layers, which agree
with their model on its own text. Use ``--spec-greedy`` with it (the draft learned the argmax path); the accept
length is reported either way, and under ``--spec-greedy`` how far each speculative answer follows the plain
engine's (``greedy_same``, ``first_diff_mean``). In bf16 a K + 1-row verify rounds differently from a one-row decode
step, so speculation's greedy path can leave the plain one at a near-tie, and the memorised draft knows nothing past
it (the suspected cause of the Qwen3.5-9B shape's accept length 1.0 on an H100): ``--mtp-fit-rounds 3`` refits twice
more on the speculative engine's own greedy answers, so the draft learns the path speculation itself takes.
A fitted draft is kept under the bench cache (``mtp-fits/``, named by the family, K, the steps, rounds and the
prompts) and reused by a later run with the same settings, so a fit that takes most of a 10-minute device call (R2
with ``--mtp-fit-rounds 2``) and its timing can be two calls on one machine. Each timed record splits its wall time
by step kind (``step_s_chained``, ``step_s_verify``, ``step_s_single``: prefill, mixed and single plain steps).
Both engines decode under CUDA graphs (``--eager``: both eager), sampling at temperature 1 as R1-R3 do, and
``--spec-greedy`` samples greedily instead (acceptance then is the argmax agreement). ``--spec-plain-after`` runs
the plain engine again after the speculative ones (rows ``plain_pass`` before / after) and takes the speed-up against
the mean of its two warm calls: a drift of the device over the run (clocks, heat) then weighs on both sides alike,
where plain-then-speculative charges it all to speculation (R1's bar is 0.98x: a 2% drift decides it). Each engine
runs its workload twice and the warm call is the measurement (the graphs are captured on the first). The plain engine
chains 8 decode steps per scheduling round (``PLAIN_DECODE_STEPS``, the rollout's ``--decode-steps`` default: what a
user without speculation runs); the speculative one chains its gated stretches likewise (areno/engine/spec_gated.py).

The gate (``--speculative-disable-by-batch-size``, areno/engine/spec_gate.py): ``--spec-gate auto,off`` runs the
speculative engine once per setting (default auto), each record with the N it resolved to (``spec_limit``) and the
steps it ran plain (``spec_gated_steps``); the bar is R1 (256 streams) with auto never below 0.98x the plain engine.
``--spec-batch-sweep`` measures instead the plain engine and speculation never gated at batch sizes 1, 4, 16, 64 and
256 (``--spec-batches`` for others; 128-token prompts, 128 new tokens) and prints where speculation stops paying next
to auto's N; ``accept_needed`` is the accept length at which it would break even at each batch (the speculative
step's cost in plain steps: accept length / speed-up), what an acceptance-aware gate would compare with. Under
``--spec-greedy`` each speculating row says how far its answers follow the plain engine's at that batch
(``greedy_same``, ``first_diff_mean``): the 12-07 sweep's accept length 2.8 at batch 1 but ~1.05 from 16 on, with
one fitted draft, is what a path that leaves the memorised one early looks like (a K + 1-row verify of 16 rows is a
48-row GEMM, rounded otherwise than the plain step's 16), and ``--mtp-fit-rounds 2`` refits on the never-gated
engine's own greedy answers at each batch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import models
import torch
from common import step_times

SHAPES = {
    "qwen3_5": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256, vocab_size=151936, full_attention_interval=4,
                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, mtp_num_hidden_layers=1, max_position_embeddings=8192),
    "bailing_hybrid": dict(hidden_size=4096, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                           vocab_size=157184, layer_group_size=4, first_k_dense_replace=1, intermediate_size=9216,
                           kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                           num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                           moe_intermediate_size=1024, num_mtp_layers=1, max_position_embeddings=8192),
}
SMOKE = {"qwen3_5": {}, "bailing_hybrid": {}}  # the test families' own tiny defaults
PLAIN_DECODE_STEPS = 8  # the plain engine: the rollout's --decode-steps default
MTP_EPOCHS = 4  # --mtp-train-steps packs each step so every training sequence is seen this many times


def mtp_checkpoint(family: str, smoke: bool) -> Path:
    """The cached random checkpoint of ``family`` at its bench shape (tiny with ``smoke``), made if absent."""
    from areno.testing import make_tiny_checkpoint

    shape = (SMOKE if smoke else SHAPES)[family]
    path = models.cache_root() / f"{family}-{'smoke' if smoke else 'bench'}-mtp-seed0"
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        make_tiny_checkpoint(tmp, family, seed=0, dtype=torch.float32 if smoke else torch.bfloat16,
                             initializer_range=0.02, **shape)  # fmt: skip
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def greedy_outputs(engine, prompt_sets) -> list[list[int]]:
    """Each prompt of ``prompt_sets`` (``[(prompts, new tokens of each)]``) with its greedy continuation: the
    sequences the MTP layer is trained on."""
    from areno.config import SamplingParams

    seqs = []
    for prompts, new in prompt_sets:
        out = engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
                                        for n in new])  # fmt: skip
        seqs += [list(p) + list(g[0].token_ids) for p, g in zip(prompts, out)]
    return seqs


def load_draft_model(args, device, prompt_sets, refit_gate="auto"):
    """The family's model on ``device`` with its MTP layer trained first when ``--mtp-train-steps`` asks (on the
    greedy continuations of ``prompt_sets(vocab)``: the prompts the bench then times), the engines' shared settings,
    and the training record. The engines run as many sequences as the largest prompt set (at least 4): a hybrid's
    recurrent-state slots and speculation's rollback stash are reserved per running sequence, and at the 9B shape
    256 of them (39.6 GB) left no KV block on an H100 for R3's single stream.

    ``--mtp-fit-rounds R`` > 1 refits R - 1 more times on what the speculative engine itself then answers greedily
    (with the plain engine's continuations): in bf16 a verify of K + 1 rows rounds differently from a one-row decode
    step, so the speculative engine's greedy path can leave the plain one at a near-tie, and a random model's draft
    knows nothing past it (it only memorised; see the module docstring). Each round's accept length and
    agreement with the plain continuations are recorded (``mtp_rounds``). ``refit_gate``: the refitting engine's
    ``--speculative-disable-by-batch-size``, the timed engine's (the sweep's ``off``: a gated refit would answer
    its large batches plainly, the path the first fit already learned)."""
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model
    from areno.training.mtp import fit_draft

    model = load_model(mtp_checkpoint(args.mtp_family, args.smoke), device=device)
    running = max(len(prompts) for prompts, _ in prompt_sets(model.config.vocab_size))  # R3 alone: 1 sequence
    base = dict(block_size=16, max_running=max(4, running), max_batched_tokens=args.max_batched_tokens,
                max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, eager_decode=args.eager)
    train = {}
    if args.mtp_train_steps:
        sets = prompt_sets(model.config.vocab_size)
        cached = fit_cache(args, sets, refit_gate)
        if cached.with_suffix(".json").is_file():  # fitted by an earlier run on this machine: the same fit
            load_fit(model, cached)
            train = {**json.loads(cached.with_suffix(".json").read_text()), "mtp_fit_cached": True}
            print("MTP training (cached):", train, flush=True)
            return model, base, train
        plain = Engine(model, None, EngineConfig(**base), eos_token_ids=[])
        seqs = greedy_outputs(plain, sets)
        plain.drop_rollout_state()
        del plain
        t0, rounds = time.perf_counter(), []
        starts = [len(p) for prompts, _ in sets for p in prompts]
        for r in range(args.mtp_fit_rounds):
            if r:
                spec = Engine(model, None, EngineConfig(speculative_tokens=args.speculative_tokens, decode_steps=1,
                                                        speculative_disable_by_batch_size=refit_gate, **base),
                              eos_token_ids=[])  # fmt: skip
                answered = greedy_outputs(spec, sets)
                rounds.append({**spec.spec.take_stats(), **agreement(seqs[: len(answered)], answered, starts)})
                spec.drop_rollout_state()
                del spec
                seqs += [s for s in answered if s not in seqs]
                print(f"MTP fit round {r}: before it {rounds[-1]}", flush=True)
            train = fit_draft(model, seqs, args.mtp_train_steps, epochs=MTP_EPOCHS)
        train.update(mtp_train_s=time.perf_counter() - t0, mtp_fit_rounds=args.mtp_fit_rounds)
        if rounds:
            train["mtp_rounds"] = rounds
        print("MTP training:", train, flush=True)
        save_fit(model, cached, train)
    return model, base, train


def fit_cache(args, sets, refit_gate="auto") -> Path:
    """Where a fitted draft is kept (its ``.safetensors`` and ``.json``) under the bench cache, named by what decides
    the fit: the family and shape, K, the steps, rounds (and the refitting engine's gate) and epochs, and the prompts
    it is fitted on. A fit can take most of a 10-minute device call (R2's 256 prompts: ~2.5 min a round), so a second
    call on the same machine reuses it."""
    shape = (SMOKE if args.smoke else SHAPES)[args.mtp_family]
    rounds = [args.mtp_fit_rounds] + ([str(refit_gate)] if args.mtp_fit_rounds > 1 else [])
    key = json.dumps([args.mtp_family, shape, args.speculative_tokens, args.mtp_train_steps, *rounds,
                      MTP_EPOCHS, [[list(p) for p in prompts] + [list(new)] for prompts, new in sets]], sort_keys=True)
    name = f"{args.mtp_family}-{'smoke' if args.smoke else 'bench'}-fit-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    return models.cache_root() / "mtp-fits" / name


def save_fit(model, path: Path, train: dict) -> None:
    """The fitted MTP tensors (the model's kept ones) and the fit's record, written atomically (the record last)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(model.mtp, f"t{j}").contiguous() for j, name in enumerate(model.mtp.names)}
    save_file(tensors, str(path.with_suffix(".tmp")))
    path.with_suffix(".tmp").rename(path.with_suffix(".safetensors"))
    path.with_suffix(".json").write_text(json.dumps(train))


@torch.no_grad()
def load_fit(model, path: Path) -> None:
    """Copy a saved fit into the model's kept MTP tensors (the engines build their drafts from those)."""
    from safetensors.torch import load_file

    saved = load_file(str(path.with_suffix(".safetensors")), device=str(model.embed_tokens.weight.device))
    for j, name in enumerate(model.mtp.names):
        getattr(model.mtp, f"t{j}").copy_(saved[name])


def agreement(reference: list[list[int]], answered: list[list[int]], starts=None) -> dict:
    """How far greedy answers follow reference ones (the same prompts; ``starts``: each sequence's prompt length,
    where the answer begins, 0 when only answers are given): ``greedy_same`` the fraction identical,
    ``first_diff_mean`` the mean index of the answer where they first differ (its length where they do not)."""
    starts = starts or [0] * len(reference)
    firsts = [next((i for i, (a, b) in enumerate(zip(x[s:], y[s:])) if a != b), min(len(x), len(y)) - s)
              for x, y, s in zip(reference, answered, starts)]
    same = sum(x == y for x, y in zip(reference, answered))
    return {"greedy_same": same / max(len(firsts), 1), "first_diff_mean": sum(firsts) / max(len(firsts), 1)}


def gates(args) -> list:
    """``--spec-gate``'s settings (auto, off, N), as EngineConfig takes them."""
    return [g if g in ("auto", "off") else int(g) for g in args.spec_gate.split(",")]


def timed_generate(engine, prompts, opts, device) -> tuple[dict, list]:
    """One ``generate`` call timed: ({output_tokens, wall_s, tok_s, and with speculation the engine's accept length
    and gated steps over the call}, completions)."""
    if engine.spec is not None:
        engine.spec.take_stats()
    if device.type == "cuda":
        torch.cuda.synchronize()
    preempted, counts = engine.scheduler.num_preemptions, dict(engine.step_counts)
    graphs = len(engine.runner.graphs)
    t0 = time.perf_counter()
    with step_times(engine) as spent:
        out = engine.generate(prompts, opts)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for g in out for c in g)
    # the KV cache's token capacity and what the call preempted (speculation's reserve shrinks the cache), its
    # scheduling steps run alone and chained, and the CUDA graphs it captured (inside the timing: a warm call that
    # captures any pays for it)
    rec = dict(output_tokens=tokens, wall_s=dt, tok_s=tokens / dt, preemptions=engine.scheduler.num_preemptions -
               preempted, kv_tokens=engine.blocks.num_blocks * engine.config.block_size,
               **{f"steps_{k}": v - counts.get(k, 0) for k, v in engine.step_counts.items()},
               graphs_captured=len(engine.runner.graphs) - graphs, **spent)  # fmt: skip
    if engine.spec is not None:
        rec.update({"spec_limit": None, **engine.spec.take_stats()})  # accept length, gated steps, the gate's last N
    return rec, out


def run_spec(args, device, names: list[str], workload) -> list[dict]:
    """Each workload with the plain engine and with ``--speculative-tokens`` under each ``--spec-gate`` setting, warm
    calls, on fresh prompts."""
    from areno.config import SamplingParams
    from areno.config.fields import ConfigError
    from areno.engine.engine import Engine, EngineConfig

    sets = lambda vocab: [workload(n, args.smoke, vocab, seed) for n in names for seed in (1, 2)]  # noqa: E731
    model, base, train = load_draft_model(args, device, sets, gates(args)[0])
    vocab = model.config.vocab_size
    records, plain_answers = [], {}
    runs = [(0, "auto", "before")] + [(args.speculative_tokens, g, None) for g in gates(args)]
    runs += [(0, "auto", "after")] if args.spec_plain_after else []
    for k, gate, plain_pass in runs:
        try:
            engine = Engine(model, None, EngineConfig(speculative_tokens=k, speculative_disable_by_batch_size=gate,
                                                      decode_steps=1 if k else PLAIN_DECODE_STEPS, **base),
                            eos_token_ids=[])
        except (ConfigError, torch.OutOfMemoryError) as e:  # e.g. no KV block left beside speculation's reserve
            print(f"speculative_tokens {k}, gate {gate}: {type(e).__name__}: {e}", flush=True)
            records += [dict(impl="areno", workload=name, call="warm", family=args.mtp_family, speculative_tokens=k,
                             spec_gate=str(gate) if k else None, error=f"{type(e).__name__}: {e}"[:300])
                        for name in names]  # fmt: skip
            torch.cuda.empty_cache() if device.type == "cuda" else None
            continue
        if k:  # every steady and gated graph now, as a server's start does: the gate's N moves with the accept
            engine.capture_graphs()  # length, and a bucket first gated in the timed warm call captured there (R2)
        for name in names:
            for call, seed in (("first", 1), ("warm", 2)):
                prompts, new = workload(name, args.smoke, vocab, seed)
                temp = 0.0 if args.spec_greedy else 1.0
                opts = [SamplingParams(temperature=temp, max_new_tokens=n, ignore_eos=True) for n in new]
                rec, out = timed_generate(engine, prompts, opts, device)
                answers = [list(g[0].token_ids) for g in out]
                if not k:
                    plain_answers.setdefault((name, call), answers)  # the first plain pass's
                elif args.spec_greedy:  # where speculation's greedy path leaves the plain engine's (bf16 rounding)
                    rec.update(agreement(plain_answers[name, call], answers))
                rec = dict(impl="areno", workload=name, call=call, family=args.mtp_family, speculative_tokens=k,
                           spec_gate=str(gate) if k else None, sequences=len(prompts), **rec, **train)
                if not k and args.spec_plain_after:
                    rec["plain_pass"] = plain_pass
                print({a: round(b, 4) if isinstance(b, float) else b for a, b in rec.items()}, flush=True)
                records.append(rec)
        engine.drop_rollout_state()
        del engine
    plain = {}  # workload: the plain engine's warm tok/s (the mean of its passes before and after speculation)
    for r in records:
        if r["call"] == "warm" and not r["speculative_tokens"] and r.get("tok_s"):
            plain.setdefault(r["workload"], []).append(r["tok_s"])
    for r in records:
        if r["call"] == "warm" and r["speculative_tokens"] and r.get("tok_s") and r["workload"] in plain:
            base = plain[r["workload"]]
            r["speedup_vs_plain"] = r["tok_s"] / (sum(base) / len(base))
            print(f"{r['workload']} gate {r['spec_gate']}: {r['tok_s']:.6g} tok/s, {r['speedup_vs_plain']:.6g}x the "
                  f"plain engine's {' / '.join(f'{t:.6g}' for t in base)} tok/s", flush=True)
    return records


SWEEP_BATCHES = (1, 4, 16, 64, 256)


def run_batch_sweep(args, device) -> list[dict]:
    """``--spec-batch-sweep``: tok/s of the plain engine and of speculation never gated (``off``) at batch sizes 1, 4,
    16, 64, 256 (prompts of 128 random tokens, 128 new tokens each; smoke: 16 and 16, batches up to 16), warm calls
    after one warm-up call of each engine; the crossover is where speculation stops paying, to set against the N that
    ``auto`` resolves to (``auto_limit``). A batch an engine cannot hold (never gated, every row's state slot and
    stash; 256 rows of the 9B shape on an H100 did not fit while the stash held K states a row) gets a row naming the
    error, and the engine is built for the next smaller one."""
    from areno.config import SamplingParams
    from areno.config.fields import ConfigError
    from areno.engine.engine import Engine, EngineConfig

    plen, new = (16 if args.smoke else 128), (16 if args.smoke else 128)
    sizes = args.spec_batches or SWEEP_BATCHES
    batches = [b for b in sizes if b <= 16] if args.smoke else sizes
    sets = lambda vocab: [(models.random_prompts(b, plen, vocab, seed=b), [new] * b) for b in batches]  # noqa: E731
    model, base, train = load_draft_model(args, device, sets, "off")
    vocab = model.config.vocab_size
    temp = 0.0 if args.spec_greedy else 1.0
    records, plain_answers = [], {}
    for k, gate in ((0, "auto"), (args.speculative_tokens, "off")):
        engine, sizes = None, list(batches)
        while engine is None and sizes:
            try:  # never gated, every row's state slot and stash are reserved: the largest batches may not fit
                engine = Engine(model, None, EngineConfig(speculative_tokens=k, speculative_disable_by_batch_size=gate,
                                                          decode_steps=1 if k else PLAIN_DECODE_STEPS,
                                                          **{**base, "max_running": max(4, *sizes)}), eos_token_ids=[])
            except (ConfigError, torch.OutOfMemoryError) as e:  # that batch's row names why; the next smaller one
                print(f"speculative_tokens {k}, batch {max(sizes)}: {type(e).__name__}: {e}", flush=True)
                records.append(dict(impl="areno", workload="spec-sweep", family=args.mtp_family, speculative_tokens=k,
                                    batch=sizes.pop(), error=f"{type(e).__name__}: {e}"[:300]))  # fmt: skip
                torch.cuda.empty_cache() if device.type == "cuda" else None
        if engine is None:
            continue
        opts = SamplingParams(temperature=temp, max_new_tokens=new, ignore_eos=True)
        # every batch's graphs before any is timed (none under --eager); the plain engine's chains of
        # PLAIN_DECODE_STEPS too (until 12-07 each plain row's timed call captured its bucket's: graphs_captured 1)
        engine.capture_graphs((1, PLAIN_DECODE_STEPS))
        engine.generate(models.random_prompts(4, plen, vocab, seed=99), opts)  # compile and warm the kernels
        for b in sizes:
            rec, out = timed_generate(engine, models.random_prompts(b, plen, vocab, seed=b), opts, device)
            answers = [list(g[0].token_ids) for g in out]
            if not k:
                plain_answers[b] = answers
            elif args.spec_greedy and b in plain_answers:  # whether speculation's greedy path left the plain one
                rec.update(agreement(plain_answers[b], answers))
            rec = dict(impl="areno", workload="spec-sweep", family=args.mtp_family, speculative_tokens=k, batch=b,
                       **rec, **train)
            print({a: round(v, 4) if isinstance(v, float) else v for a, v in rec.items()}, flush=True)
            records.append(rec)
        engine.drop_rollout_state()
        del engine
    if not sizes:  # not even the smallest batch fits never gated
        return records
    auto = Engine(model, None, EngineConfig(speculative_tokens=args.speculative_tokens,  # the never-gated one's size
                                            **{**base, "max_running": max(4, *sizes)}), eos_token_ids=[])
    plain = {r["batch"]: r["tok_s"] for r in records if not r["speculative_tokens"] and r.get("tok_s")}
    for r in records:
        if r["speculative_tokens"] and r.get("tok_s") and r["batch"] in plain:
            r["speedup_vs_plain"], r["auto_limit"] = r["tok_s"] / plain[r["batch"]], auto.spec.limit
            if r.get("spec_accept_len"):  # a step's cost over a plain step's: the accept length where it breaks even
                r["accept_needed"] = r["spec_accept_len"] / r["speedup_vs_plain"]
            gate = auto.spec.gate
            if gate is not None and gate.fixed is None:  # what auto's roofline rule takes that ratio to be
                b = r["batch"]
                r["accept_model"] = gate.speculative(b) / gate.plain(b)
    auto.drop_rollout_state()
    return records


def crossover(records: list[dict]) -> str:
    """One line: the batches where speculation (never gated) beats the plain engine, and the batch from which on it
    loses at every size measured (the crossover), next to the N that auto resolves to."""
    spec = sorted((r for r in records if r.get("speedup_vs_plain") is not None), key=lambda r: r["batch"])
    wins = [r["batch"] for r in spec if r["speedup_vs_plain"] >= 1.0]
    stop = None
    for r in reversed(spec):
        if r["speedup_vs_plain"] >= 1.0:
            break
        stop = r["batch"]
    limit = spec[0]["auto_limit"] if spec else None
    losses = [r["batch"] for r in spec if r["speedup_vs_plain"] < 1.0]
    tail = f"it loses from batch {stop} on" if stop is not None else "it pays at the largest batch measured"
    needed = ", ".join(f"{r['batch']}: {r['accept_needed']:.2f}" for r in spec if r.get("accept_needed"))
    return (f"speculation pays at batch {wins or 'none'}, loses at {losses or 'none'}; {tail}; auto speculates up to "
            f"batch {limit}; accept length needed to break even by batch: {needed or 'n/a'}")

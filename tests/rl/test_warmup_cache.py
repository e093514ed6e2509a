"""The quickstart's cached SFT warm-up (areno/rl/warmup_cache.py): the first run trains and caches it, the next one
with the same inputs loads it and then trains bit for bit as a run without the cache (weights, every RL metric, the
warm-up's metrics lines); a change of any input the warm-up reads names another entry, while the RL-only flags and the
output folders do not. A shortened quickstart (4 warm-up steps, 2 RL steps), in process."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from areno.cli import make_parser, parse_config
from areno.config import TrainConfig
from areno.models import load_model
from areno.rl import warmup_cache
from areno.rl.loop import TrainLoop
from areno.training.data import Prompt
from areno.training.optimizer import MasterAdamW

SHORT = ["--sft-warmup-steps", "4", "--max-steps", "2", "--batch-size", "8", "--n-samples", "2",
         "--dataset-path", "n_eval=8", "--eval-interval", "0", "--log-interval", "1"]
TIMED = ("time", "peak_mem_gib", "overlap_groups")


def config(*argv) -> TrainConfig:
    return parse_config(make_parser("train", TrainConfig), TrainConfig, ["--preset", "quickstart", *SHORT, *argv])


def train(cfg, out: Path, capsys):
    loop = TrainLoop(replace(cfg, save_path=str(out)))
    try:
        loop.setup()
        loop.fit()
        weights = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    finally:
        loop.close()
    if cfg.lora_rank:  # the adapter, beside the base
        weights |= {"adapter." + k: v for k, v in load_file(str(out / "step-2" / "adapter_model.safetensors")).items()}
    records = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return records, weights, capsys.readouterr().out


def untimed(records, warmup: bool):
    return [{k: v for k, v in r.items() if k not in TIMED and not k.endswith(("_s", "tok_s"))}
            for r in records if (r["step"] <= 0) == warmup]


def test_a_cached_warmup_trains_bit_for_bit_as_a_fresh_one(areno_home, tmp_path, monkeypatch, capsys):
    """The entry a run caches serves a later run with other RL settings, and a LoRA run: each trains as it does
    uncached."""
    cfg, other_rl = config(), config("--max-new-tokens", "5")
    monkeypatch.setenv("ARENO_WARMUP_CACHE", "off")
    plain, w0, _ = train(other_rl, tmp_path / "plain", capsys)
    assert not (areno_home / "warmup").exists()  # off: nothing cached
    monkeypatch.setenv("ARENO_WARMUP_CACHE", "on")
    first, _, out1 = train(cfg, tmp_path / "first", capsys)
    assert "reused cached checkpoint" not in out1 and len(list((areno_home / "warmup").glob("*.pt"))) == 1
    again, w2, out2 = train(other_rl, tmp_path / "again", capsys)
    assert "SFT warm-up: reused cached checkpoint" in out2, out2[-2000:]
    assert [r["step"] for r in again] == [r["step"] for r in plain] and len(untimed(plain, True)) == 4
    assert untimed(again, False) == untimed(plain, False)  # every RL metric, to the bit
    assert untimed(first, False) != untimed(plain, False)  # (the shorter samples changed the RL steps)
    assert untimed(again, True) == untimed(first, True) == untimed(plain, True)
    lines = [[{k: v for k, v in r.items() if k != "time"} for r in run if r["step"] <= 0] for run in (first, again)]
    assert lines[0] == lines[1]  # the warm-up's lines, timings too: those of the run that cached it
    # the RL steps moved the weights from the cached state (Adam's moments from the warm-up, restored, move them
    # even where this short run's rewards give no gradient) and the model before the warm-up
    entry = torch.load(next((areno_home / "warmup").glob("*.pt")), weights_only=True)
    start = load_model(cfg.ckpt, dtype=torch.float32, device=torch.device("cpu")).state_dict()
    assert entry["optimizer"]["step"] == 4 and any(not torch.equal(entry["model"][k], w0[k]) for k in w0)
    assert any(not torch.equal(entry["model"][k], start[k]) for k in start)
    assert all(torch.equal(w0[k], w2[k]) for k in w0)
    # a LoRA run's warm-up trains the base with the adapter off: the full run's warm-up, whose weights it loads
    lora = config("--lora-rank", "16")
    monkeypatch.setenv("ARENO_WARMUP_CACHE", "off")
    plain, w0, _ = train(lora, tmp_path / "lora-plain", capsys)
    monkeypatch.setenv("ARENO_WARMUP_CACHE", "on")
    cached, w1, out = train(lora, tmp_path / "lora-cached", capsys)
    assert "SFT warm-up: reused cached checkpoint" in out, out[-2000:]
    assert untimed(cached, False) == untimed(plain, False) and untimed(cached, True) == untimed(plain, True)
    assert w0.keys() == w1.keys() and any(k.startswith("adapter.") for k in w0)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # the base the warm-up trained, and the adapter
    assert (tmp_path / "lora-cached" / "step-2" / "base" / "model.safetensors").exists()  # its own base, saved
    other, _, out = train(config("--seed", "1"), tmp_path / "other", capsys)  # another seed: another warm-up
    assert "reused cached checkpoint" not in out and len(list((areno_home / "warmup").glob("*.pt"))) == 2


def test_the_key_follows_every_input_of_the_warmup_and_nothing_after_it(areno_home, tmp_path, monkeypatch):
    cfg = config()
    rows = [Prompt({}, i, [1, 2, 3 + i], responses={"response": [4, 5, 2]}) for i in range(3)]
    cpu = torch.device("cpu")
    base = warmup_cache.key(cfg, rows, cpu)
    assert warmup_cache.key(cfg, rows, cpu) == base
    for field, value in [("seed", 1), ("sft_warmup_steps", 5), ("temperature", 0.7), ("sft_warmup_lr", 1e-3),
                         ("lr", 1e-4), ("batch_size", 16), ("mini_bs", 4), ("weight_decay", 0.1), ("grad_clip", 0.5),
                         ("lr_decay_style", "cosine"), ("dtype", "bfloat16"), ("log_interval", 2)]:
        assert warmup_cache.key(replace(cfg, **{field: value}), rows, cpu) != base, field
    for after in [dict(max_steps=12), dict(eval_interval=5), dict(top_p=0.9), dict(max_new_tokens=8),
                  dict(save_path=str(tmp_path / "x")),
                  dict(metrics_dir=str(tmp_path / "m")), dict(overwrite=False),
                  dict(train_devices="0", rollout_devices="1", max_staleness=1)]:  # the async split quickstart
        assert warmup_cache.key(replace(cfg, **after), rows, cpu) == base, after
    changed = [Prompt({}, 0, [1, 2, 3], responses={"response": [4, 6, 2]}), *rows[1:]]
    assert warmup_cache.key(cfg, changed, cpu) != base  # another demonstration
    assert warmup_cache.key(cfg, rows[::-1], cpu) != base  # another order
    weights = Path(cfg.ckpt) / "model.safetensors"
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the starting model
        assert warmup_cache.key(cfg, rows, cpu) != base
    finally:
        weights.write_bytes(data)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # float rounding follows the thread count
        assert warmup_cache.key(cfg, rows, cpu) != base
    finally:
        torch.set_num_threads(threads)
    lora = dict(lora_rank=16, lora_alpha=8, lora_target_modules="q_proj,v_proj")  # the warm-up trains the base
    assert warmup_cache.key(replace(cfg, **lora), rows, cpu) == base
    assert warmup_cache.enabled(cfg, 1) and not warmup_cache.enabled(cfg, 2)
    assert not warmup_cache.enabled(replace(cfg, preset=None), 1)
    assert not warmup_cache.enabled(replace(cfg, lora_rank=16, quantize_base="nf4"), 1)
    monkeypatch.setenv("ARENO_WARMUP_CACHE", "off")
    assert not warmup_cache.enabled(cfg, 1)


def test_a_warmup_that_drew_random_numbers_is_not_cached(tmp_path):
    """Its result would depend on the generators' state before it, which the key does not hold."""
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizer=MasterAdamW(list(model.parameters())))  # what an entry reads of a trainer
    before = warmup_cache.rng_fingerprint()
    assert warmup_cache.save(tmp_path / "a.pt", model, trainer, [], before) and (tmp_path / "a.pt").exists()
    torch.rand(1)
    assert not warmup_cache.save(tmp_path / "b.pt", model, trainer, [], before) and not (tmp_path / "b.pt").exists()


def test_a_lora_runs_entry_holds_weights_that_only_lora_runs_take(tmp_path):
    """A LoRA run's warm-up ends with its base's optimizer: its entry holds the weights alone, which a full run (that
    needs the optimizer's state too) does not take; it trains and writes a complete entry over it."""
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizer=MasterAdamW(list(model.parameters())))
    path, other = tmp_path / "e.pt", torch.nn.Linear(2, 2)
    rng = warmup_cache.rng_fingerprint()  # no random numbers drawn from here on
    assert warmup_cache.save(path, model, None, [(0, {"warmup_loss": 1.0})], rng)
    assert warmup_cache.load(path, other, trainer) is None  # a full run: no optimizer state to go on with
    assert warmup_cache.load(path, other, None) == [(0, {"warmup_loss": 1.0})]  # a LoRA run: the weights
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert warmup_cache.save(path, model, trainer, [], rng)  # the full run's entry replaces it
    assert not warmup_cache.save(path, model, None, [], rng)  # and a LoRA run never overwrites one
    assert torch.load(path, weights_only=True)["optimizer"] is not None


def test_a_cache_that_cannot_be_written_does_not_stop_the_run(tmp_path):
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizer=MasterAdamW(list(model.parameters())))
    (tmp_path / "file").write_text("")  # a file where the cache folder would go
    assert not warmup_cache.save(tmp_path / "file" / "e.pt", model, trainer, [], warmup_cache.rng_fingerprint())

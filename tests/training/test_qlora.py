"""QLoRA (`--quantize-base nf4`): the base's projections held as NF4 (bitsandbytes' format), the same function as the
dequantised weights, one step trains the adapter only (loss down, base bytes unchanged), the reference is the
quantised base with the adapter off; quantised as it loads: the bytes, adapter and logits of load-then-quantise, one
full-precision projection alive at a time, refusals before any weight is read; through `areno train`: the base
quantised at load, PEFT files, --merge-lora into the dequantised base, exact resume of a warm-up-trained quantised
base, and what is not built exits 2 naming the flag."""

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from areno.cli import main
from areno.kernels.nf4 import dequantize_nf4
from areno.models import load_model
from areno.models.layers import Linear
from areno.models.lora import LoraError, LoraSpec, attach
from areno.models.qlora import dequantized, nf4_state, quantizable, quantize_base, quantized_modules
from areno.training.lora import BaseModel

IDS = torch.tensor([[1, 2, 3, 4, 5, 6]])


def _forward(model):
    ids, pos, cu = IDS[0], torch.arange(IDS.shape[1]), torch.tensor([0, IDS.shape[1]], dtype=torch.int32)
    return model(ids, pos, cu_seqlens=cu, max_seqlen=IDS.shape[1])


def test_one_qlora_step_trains_the_adapter_on_the_quantised_base(inputs):
    ckpt = inputs[0]
    model = load_model(ckpt, device="cpu", dtype=torch.float32, attn_backend="native")
    adapter = attach(model, LoraSpec(4, 8.0))
    before, after = quantize_base(model)
    held = quantized_modules(model)
    assert len(held) == 4 * len(model.layers)  # qkv, o, gate_up, down in every layer
    assert after < 0.3 * before  # 0.52 byte a weight vs 4 (fp32)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("proj.weight") for n in names)
    assert "embed_tokens.weight" in names  # embeddings and norms stay
    # the same function as the plain model holding the dequantised weights (adapter B = 0: the base)
    plain = load_model(ckpt, device="cpu", dtype=torch.float32, attn_backend="native")
    plain_modules = dict(plain.named_modules())
    with torch.no_grad():
        for name, m in held.items():
            plain_modules[name].weight.copy_(dequantize_nf4(m.nf4()))
        torch.testing.assert_close(_forward(model), _forward(plain), rtol=1e-5, atol=1e-5)
    bytes_before = {k: v.clone() for k, v in nf4_state(model).items()}
    a0 = {k: v.detach().clone() for k, v in adapter.named_parameters()}
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    target = torch.tensor([2, 3, 4, 5, 6, 7])
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model.logits(IDS)[0], target)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0], losses
    assert any(not torch.equal(a0[k], v) for k, v in adapter.named_parameters())
    assert all(torch.equal(bytes_before[k], v) for k, v in nf4_state(model).items())  # the base never moves
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # the reference: the quantised base with the adapter off, the plain model's function
        torch.testing.assert_close(BaseModel(model)(*_args()), plain(*_args()), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(*_args()), plain(*_args()), atol=1e-4)
    with dequantized(model):  # saving/merging sees the dequantised weights as parameters, then they go again
        lent = dict(model.named_parameters())["layers.0.mlp.down_proj.weight"]
        assert torch.equal(lent, plain_modules["layers.0.mlp.down_proj"].weight)
    assert "layers.0.mlp.down_proj.weight" not in dict(model.named_parameters())


def _args():
    return IDS[0], torch.arange(IDS.shape[1]), torch.tensor([0, IDS.shape[1]], dtype=torch.int32)


def test_quantised_forward_through_the_triton_kernel_matches_native(inputs, monkeypatch):
    model = load_model(inputs[0], device="cpu", dtype=torch.float32, attn_backend="native")
    attach(model, LoraSpec(4, 8.0))
    quantize_base(model)
    with torch.no_grad():
        native = model.logits(IDS)
        monkeypatch.setattr("areno.kernels.nf4.use_triton", lambda *t, supported=True: supported)
        torch.testing.assert_close(model.logits(IDS), native, rtol=1e-4, atol=1e-4)


def _argv(inputs, out, algo, *extra, steps=1):
    ckpt, data, reward = inputs
    argv = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "2",
            "--mini-bs", "2", "--max-steps", str(steps), "--save-path", str(out), "--lr", "1e-2", "--no-tensorboard",
            "--dtype", "float32", "--lora-rank", "4", "--quantize-base", "nf4", "--seed", "3", *extra]
    if algo == "grpo":
        argv += ["--reward-fn-path", str(reward), "--n-samples", "4", "--max-new-tokens", "4", "--kl-coef", "0.1"]
    return argv


@pytest.mark.slow  # one GRPO step with rollout, the merged weights read back by transformers
def test_a_qlora_grpo_step_saves_the_adapter_and_merges_into_the_dequantised_base(inputs, tmp_path):
    transformers = pytest.importorskip("transformers")
    assert main(_argv(inputs, tmp_path / "out", "grpo", "--merge-lora")) == 0
    saved = tmp_path / "out" / "step-1"
    assert (saved / "adapter_model.safetensors").exists() and not (saved / "model.safetensors").exists()
    assert not (saved / "base").exists()  # the base is --ckpt's, quantised again at load
    line = [json.loads(x) for x in (tmp_path / "out" / "metrics" / "metrics.jsonl").read_text().splitlines()
            if "logprob_diff" in x][0]
    assert line["logprob_diff"] < 1e-4  # the rollout ran the same quantised base and unmerged adapter
    ours = load_model(inputs[0], device="cpu", dtype=torch.float32, attn_backend="native")
    adapter = attach(ours, LoraSpec(4, 8.0))
    adapter.load_weights(saved)
    quantize_base(ours)  # deterministic: the run's bytes
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(saved / "merged"), dtype=torch.float32,
                                                               attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, ours.logits(IDS), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_resume_of_a_warm_up_trained_quantised_base_is_exact(inputs, tmp_path):
    run = ("grpo", "--save-interval", "1", "--sft-warmup-steps", "2")
    assert main(_argv(inputs, tmp_path / "straight", *run, steps=2)) == 0
    assert main(_argv(inputs, tmp_path / "cut", *run, steps=1)) == 0
    assert (tmp_path / "cut" / "step-1" / "base_nf4.safetensors").exists()
    assert main(_argv(inputs, tmp_path / "cut", *run, "--resume", steps=2)) == 0
    for name in ("adapter_model.safetensors", "base_nf4.safetensors"):
        a = load_file(str(tmp_path / "straight" / "step-2" / name))
        b = load_file(str(tmp_path / "cut" / "step-2" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("extra,flag", [
    (["--lora-rank", "0"], "--quantize-base"),  # nf4 without an adapter
    (["--train-devices", "0", "--rollout-devices", "1"], "--quantize-base"),
    (["--world-size", "2", "--tp-size", "2"], "--quantize-base"),
    (["--train-cuda-graphs", "on", "--no-activation-checkpointing"], "--quantize-base"),
])
def test_what_is_not_built_exits_2_naming_the_flag(inputs, tmp_path, extra, flag, capsys):
    assert _exit_code([*_argv(inputs, tmp_path / "out", "grpo"), *extra]) == 2
    assert flag in capsys.readouterr().err


def test_a_moe_base_is_refused_naming_the_family(tmp_path, inputs, capsys):
    from areno.testing import make_tiny_checkpoint

    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)
    assert _exit_code(_argv((moe, *inputs[1:]), tmp_path / "out", "sft")) == 2
    err = capsys.readouterr().err
    assert "--quantize-base" in err and "qwen3_moe" in err


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code



@pytest.mark.parametrize("family,dtype", [("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                                          ("qwen3_5", torch.float32)])
def test_quantise_on_load_gives_the_bytes_adapter_and_logits_of_load_then_quantise(tmp_path, family, dtype):
    from areno.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / family, family, seed=1)
    torch.manual_seed(0)
    after = load_model(ckpt, device="cpu", dtype=dtype, attn_backend="native")
    adapter_after = attach(after, LoraSpec(4, 8.0))
    quantize_base(after)
    torch.manual_seed(0)  # the adapter's init draws the same numbers whichever order
    onload = load_model(ckpt, device="cpu", dtype=dtype, attn_backend="native", quantize_base="nf4")
    assert set(quantized_modules(onload)) == set(quantizable(onload))  # all quantised by the loader itself
    adapter = attach(onload, LoraSpec(4, 8.0))
    assert quantize_base(onload) == (0, 0)  # nothing left to do
    theirs, mine = nf4_state(after), nf4_state(onload)
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    assert all(m.nf4_dtype == dtype for m in quantized_modules(onload).values())
    theirs, mine = dict(after.named_parameters()), dict(onload.named_parameters())
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    assert all(p.dtype == theirs[k].dtype and not p.requires_grad for k, p in mine.items())
    a, b = dict(adapter_after.named_parameters()), dict(adapter.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert [s.module for s in adapter.sites] == [s.module for s in adapter_after.sites]
    assert [id(p) for p in adapter.base_trainable] == [id(mine[k]) for k, p in theirs.items()
                                                       if any(p is q for q in adapter_after.base_trainable)]
    with torch.no_grad():
        for x, y in zip(adapter_after.parameters(), adapter.parameters()):  # B moved: the adapter counts too
            x.normal_(0, 0.1, generator=torch.Generator().manual_seed(x.numel()))
            y.copy_(x)
        assert torch.equal(onload.logits(IDS), after.logits(IDS))
        with adapter.disabled(), adapter_after.disabled():  # the reference: the quantised base
            assert torch.equal(onload.logits(IDS), after.logits(IDS))


def _spy_full_precision(monkeypatch) -> tuple[list, list]:
    """``(seen, holder)``: ``seen`` gets, each time a quantisable projection's weight is made on the device and each
    time one is quantised, the bytes of those full-precision weights then alive (held by the model ``holder[0]``, or
    by anything else: weakrefs of every one made); ``holder`` gets the model ``loader.materialize`` is given."""
    from areno.models import loader

    seen, holder, made = [], [], []
    real_materialize, real_make, real_quantize = loader.materialize, loader.make_parameter, Linear.quantize_nf4_

    def alive_bytes():
        modules = dict(holder[0].named_modules())
        weights = [r() for r in made] + [modules[n]._parameters.get("weight") for n in quantizable(holder[0])]
        alive = {id(w): w for w in weights if w is not None and not w.is_meta}
        return sum(w.numel() * w.element_size() for w in alive.values())

    def materialize(model, *args, **kwargs):
        holder[:] = [model]
        real_materialize(model, *args, **kwargs)

    def make(module, name, *args):
        p = real_make(module, name, *args)
        if any(module is dict(holder[0].named_modules())[n] for n in quantizable(holder[0])):
            made.append(weakref.ref(p))
            seen.append(alive_bytes())
        return p

    def quantize(self, q=None):
        made.append(weakref.ref(self.weight))
        seen.append(alive_bytes())
        real_quantize(self, q)

    monkeypatch.setattr(loader, "materialize", materialize)
    monkeypatch.setattr(loader, "make_parameter", make)
    monkeypatch.setattr(Linear, "quantize_nf4_", quantize)
    return seen, holder


def test_quantise_on_load_holds_one_full_precision_projection_at_a_time(tmp_path, monkeypatch):
    from areno.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=0, num_hidden_layers=3)
    seen, holder = _spy_full_precision(monkeypatch)
    model = load_model(ckpt, device="cpu", dtype=torch.float32, quantize_base="nf4")
    sizes = [m.nf4_shape[0] * m.nf4_shape[1] * 4 for m in quantized_modules(model).values()]
    assert len(sizes) == 4 * 3
    # made, then quantised, one projection after the other: never a second one alive (nor the whole base)
    assert seen == [size for size in sizes for _ in range(2)] and max(seen) == max(sizes)
    # the bound is real: load-then-quantise holds every projection at the first quantisation
    seen.clear()
    plain = load_model(ckpt, device="cpu", dtype=torch.float32)
    seen.clear()
    quantize_base(plain)
    assert seen[0] == sum(sizes)


def test_quantise_on_load_refuses_before_reading_a_weight(tmp_path, monkeypatch):
    from areno.models import loader
    from areno.testing import make_tiny_checkpoint

    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)

    def never(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "materialize", never)
    monkeypatch.setattr(loader, "load_hf_weights", never)
    with pytest.raises(LoraError, match="--quantize-base: nf4 on the MoE model qwen3_moe"):
        load_model(moe, device="cpu", quantize_base="nf4")
    with pytest.raises(ValueError, match="quantize_base"):
        load_model(moe, device="cpu", quantize_base="int4")


def test_a_qlora_sft_run_quantises_the_base_as_it_loads(inputs, tmp_path, monkeypatch):
    """`areno train --quantize-base nf4` without a warm-up: the loader quantises every projection (apply finds
    nothing left), the adapter trains, and the saved adapter gives the same logits on either way's base."""
    from areno.models import loader, qlora

    loads, left = [], []
    real_on_load, real_quantize = loader.nf4_on_load, qlora.quantize_base
    monkeypatch.setattr(loader, "nf4_on_load", lambda *a: loads.append(a[0]) or real_on_load(*a))
    monkeypatch.setattr(qlora, "quantize_base", lambda model: left.append(real_quantize(model)) or left[-1])
    assert main(_argv(inputs, tmp_path / "out", "sft", steps=2)) == 0
    assert len(loads) == 1 and left == [(0, 0)]  # the policy only (the reference is the base, adapter off)
    saved = tmp_path / "out" / "step-2"
    tensors = load_file(str(saved / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in tensors.items())  # B moved
    assert not (saved / "base").exists() and not (saved / "base_nf4.safetensors").exists()
    losses = [json.loads(x)["loss"] for x in (tmp_path / "out" / "metrics" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == 2 and all(x == x for x in losses)
    ours = load_model(inputs[0], device="cpu", dtype=torch.float32, attn_backend="native")
    attach(ours, LoraSpec(4, 8.0)).load_weights(saved)
    real_quantize(ours)
    again = load_model(inputs[0], device="cpu", dtype=torch.float32, attn_backend="native", quantize_base="nf4")
    attach(again, LoraSpec(4, 8.0)).load_weights(saved)
    with torch.no_grad():
        assert torch.equal(again.logits(IDS), ours.logits(IDS))

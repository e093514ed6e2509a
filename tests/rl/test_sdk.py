"""The Trainer SDK of the spec: construct, init, generate, train, save, close."""

import json

import torch

from areno import Trainer
from areno.api import CUDA, CudaConfig, SamplingParams
from areno.models import load_model
from areno.testing import make_tiny_checkpoint


def test_sdk_generate_train_save(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    trainer = Trainer(world_size=1, model_path=ckpt, backend_type=CUDA,
                      custom_config=CudaConfig(tp_size=1, max_running_prompts=8, runtime={"attn_backend": "native"}),
                      dtype="float32", lr=1e-3, tensorboard=False, metrics_dir=str(tmp_path / "m"))
    with trainer:
        trainer.init()
        out = trainer.generate(["12 + 3 =", [{"role": "user", "content": "hi"}]],
                               SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=1))
        assert [len(g) for g in out] == [2, 2] and all(len(c.token_ids) == len(c.logprobs) for g in out for c in g)
        # every completion has its text: the tokens decoded without special tokens (as the loop's evaluate does)
        tok = trainer.loop.tokenizer
        assert all(c.text == tok.decode(c.token_ids, skip_special_tokens=True) for g in out for c in g)
        assert all(c.text for g in out for c in g)  # 5 sampled tokens, none special here
        # a stop string: the engine's text (cut before it) is kept, not replaced by the decoded tokens
        first = out[0][0]
        stop = first.text[2]
        stopped = trainer.generate([list(first.prompt_ids)], SamplingParams(
            temperature=1.0, max_new_tokens=5, n=2, seed=1, stop=[stop]))
        assert (stopped[0][0].text, stopped[0][0].stop_text) == (first.text[:first.text.index(stop)], stop)
        # structured output: a JSON schema the completions follow (constrained decoding), EOS dropped from the text
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
        shaped = trainer.generate(["12 + 3 ="], SamplingParams(max_new_tokens=40, n=2, seed=1, grammar={
            "type": "json_schema", "schema": schema}))
        for c in shaped[0]:
            obj = json.loads(c.text)
            assert c.finish_reason == "stop" and set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 9
        before = [p.detach().clone() for p in trainer.model.parameters()]
        rows = [{"prompt_ids": list(c.prompt_ids), "response_ids": c.token_ids} for g in out for c in g]
        stats = trainer.train(rows, loss_fn="sft", mini_bs=2, gradient_accumulation_steps=2)
        assert stats["num_updates"] == 1 and stats["loss"] > 0
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        saved = trainer.save_checkpoint(tmp_path / "saved")
    reloaded = load_model(saved, dtype=torch.float32, device="cpu")
    ids = torch.tensor([[3, 4, 5]])
    assert torch.allclose(reloaded.logits(ids), trainer_logits(saved, ids), atol=1e-4)


def trainer_logits(path, ids):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits


def test_sdk_without_a_metrics_dir_gets_its_own_run_folder(tmp_path, monkeypatch):
    """Like `areno train`, a Trainer given no metrics_dir / save_path writes to its own runs/<date>-<time>-<pid> and
    points runs/latest at it (two scripts never interleave their rows in one folder)."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(world_size=1, model_path=ckpt, backend_type=CUDA, dtype="float32", lr=1e-3, tensorboard=False,
                      custom_config=CudaConfig(tp_size=1, max_running_prompts=8, runtime={"attn_backend": "native"}))
    with trainer:
        trainer.init()
        folder = trainer.loop.cfg.metrics_dir
    latest = tmp_path / "runs" / "latest"
    assert folder and folder.startswith("runs/") and folder != "runs/latest"
    assert latest.is_symlink() and latest.resolve() == (tmp_path / folder).resolve()

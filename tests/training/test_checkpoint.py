"""Checkpoints: layout, atomic replace, SIGKILL during a save, latest_checkpoint, RNG and optimizer round trips, the
real areno save_model, and two gloo ranks writing their own optimizer shards."""

import json
import os
import random
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areno.training.checkpoint import DiskFullError, latest_checkpoint, load_checkpoint, recover, save_checkpoint
from areno.training.optimizer import MasterAdamW


def save_tensors(model, folder, tokenizer=None):
    """A stand-in for areno.models.save_model: the weights and a config at the top level (rank 0 writes)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))


def toy_model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)


def train_steps(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step(lr=1e-2, grad_clip=1.0)


def test_layout_atomic_replace_and_latest(tmp_path):
    model = toy_model()
    opt = MasterAdamW(list(model.parameters()), weight_decay=0.1)
    train_steps(model, opt, 2, seed=1)
    root = tmp_path / "ckpts"
    first = save_checkpoint(root / "step-2", model=model, optimizer=opt, trainer_state={"step": 2, "path": root},
                            scheduler_state={"style": "cosine"}, save_model_fn=save_tensors)
    files = {str(p.relative_to(first)) for p in first.rglob("*")}
    assert files == {"model.safetensors", "config.json", "COMPLETE", "training_state", "training_state/trainer.json",
                     "training_state/optimizer-rank0.pt", "training_state/rng-rank0.pt"}
    state = load_checkpoint(first, rng=False)
    assert state == {"step": 2, "path": str(root), "scheduler_state": {"style": "cosine"}}
    # saving over an existing checkpoint replaces it whole and leaves nothing behind
    train_steps(model, opt, 1, seed=2)
    save_checkpoint(root / "step-2", model=model, optimizer=opt, trainer_state={"step": 3}, save_model_fn=save_tensors)
    assert load_checkpoint(first, rng=False) == {"step": 3}
    weights = load_file(str(first / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    # latest: the highest complete step-N; incomplete or unrelated folders are ignored
    save_checkpoint(root / "step-10", model=model, trainer_state={"step": 10}, save_model_fn=save_tensors)
    (root / "step-12").mkdir()
    (root / "step-12" / "config.json").write_text("{}")
    (root / "notes").mkdir()
    assert latest_checkpoint(root) == root / "step-10"
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match=r"step-12 is not a complete areno checkpoint"):
        load_checkpoint(root / "step-12")
    # killed between "rename the old away" and "rename the new in": recover() puts the complete old copy back under
    # its own name (never loaded by its hidden name); one whose process still lives is left to it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.rename(root / "step-10", root / f".step-10.old-{dead.pid}-abcdef12")
    assert latest_checkpoint(root) == root / "step-2"
    os.rename(root / "step-2", root / f".step-2.old-{os.getpid()}-abcdef12")
    assert recover(root) == [root / "step-10"]
    assert latest_checkpoint(root) == root / "step-10"
    assert load_checkpoint(latest_checkpoint(root), rng=False) == {"step": 10}
    assert sorted(p.name for p in root.iterdir()) == [f".step-2.old-{os.getpid()}-abcdef12", "notes", "step-10",
                                                      "step-12"]


def test_rng_round_trip(tmp_path):
    model = toy_model()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), np.random.randn()  # a cached gaussian is part of the state
    save_checkpoint(tmp_path / "step-1", model=model, trainer_state={}, save_model_fn=save_tensors)

    def draw():
        return random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist(), torch.randint(
            0, 1000, (2,)).tolist()

    want = draw()
    draw()
    load_checkpoint(tmp_path / "step-1")
    assert draw() == want


def test_optimizer_state_resume_gives_the_same_next_update(tmp_path):
    model = toy_model()
    opt = MasterAdamW(list(model.parameters()), weight_decay=0.1, betas=(0.9, 0.95))
    train_steps(model, opt, 3, seed=1)
    torch.manual_seed(11)
    save_checkpoint(tmp_path / "step-3", model=model, optimizer=opt, trainer_state={"step": 3},
                    save_model_fn=save_tensors)
    noise = torch.randn(4)
    train_steps(model, opt, 2, seed=9)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    # a fresh process: model from the checkpoint's weights, a new optimizer, state and RNG restored
    resumed = toy_model(seed=5)
    resumed.load_state_dict(load_file(str(tmp_path / "step-3" / "model.safetensors")))
    opt2 = MasterAdamW(list(resumed.parameters()), weight_decay=0.1, betas=(0.9, 0.95), offload="disk",
                       offload_dir=tmp_path / "scratch")
    assert load_checkpoint(tmp_path / "step-3", optimizer=opt2) == {"step": 3}
    assert opt2.num_steps == 3 and torch.equal(torch.randn(4), noise)
    train_steps(resumed, opt2, 2, seed=9)
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # without the optimizer state the next update differs (the fp32 masters and moments matter)
    fresh = toy_model(seed=5)
    fresh.load_state_dict(load_file(str(tmp_path / "step-3" / "model.safetensors")))
    train_steps(fresh, MasterAdamW(list(fresh.parameters()), weight_decay=0.1, betas=(0.9, 0.95)), 2, seed=9)
    assert not all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    opt2.close()


KILLED_SAVE = """
import sys, time, torch
from pathlib import Path
from safetensors.torch import save_file
from areno.training.checkpoint import save_checkpoint

def slow_save(model, folder, tokenizer=None):
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    print("WRITING", folder, flush=True)
    time.sleep(120)

model = torch.nn.Linear(4, 4)
save_checkpoint(Path(sys.argv[1]), model=model, trainer_state={"step": 99}, save_model_fn=slow_save)
"""


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    model = toy_model()
    save_checkpoint(root / "step-1", model=model, trainer_state={"step": 1}, save_model_fn=save_tensors)
    before = load_file(str(root / "step-1" / "model.safetensors"))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(root / "step-1")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the model file is written; the save is now sleeping mid-way
        assert line.startswith("WRITING"), proc.stderr.read() if proc.poll() is not None else line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    partial = root / line.split()[1].rsplit("/", 1)[1]
    assert partial.name.startswith(f".step-1.tmp-{proc.pid}-") and (partial / "model.safetensors").is_file()
    assert latest_checkpoint(root) == root / "step-1"
    assert load_checkpoint(root / "step-1", rng=False) == {"step": 1}
    after = load_file(str(root / "step-1" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(FileNotFoundError, match=partial.name):
        load_checkpoint(partial)
    # the next save clears what the dead process left
    save_checkpoint(root / "step-2", model=model, trainer_state={"step": 2}, save_model_fn=save_tensors)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]
    assert latest_checkpoint(root) == root / "step-2"


def test_real_save_model_checkpoint_reloads(tmp_path):
    from areno.models import load_model
    from areno.testing.checkpoints import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "qwen3", seed=0)
    model = load_model(src, device="cpu")
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], bucket_bytes=2**16)
    train_steps(model, opt, 1, seed=3)
    out = save_checkpoint(tmp_path / "run" / "step-1", model=model, optimizer=opt, trainer_state={"step": 1})
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file() and (out / "COMPLETE").is_file()
    assert (out / "training_state" / "optimizer-rank0.pt").is_file()
    reloaded = dict(load_model(out, device="cpu").named_parameters())
    assert all(torch.equal(p, reloaded[n]) for n, p in model.named_parameters())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-1"]


# ---- two gloo ranks -------------------------------------------------------------------------------------------
def _worker(rank, port, root):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = toy_model(dtype=torch.float32)
        opt = MasterAdamW(list(model.parameters()), dp_group=dist.group.WORLD, bucket_bytes=64)
        train_steps(model, opt, 2, seed=1 + rank)  # different grads per rank, summed
        torch.manual_seed(100 + rank)
        path = save_checkpoint(os.path.join(root, "step-2"), model=model, optimizer=opt, trainer_state={"step": 2},
                               save_model_fn=save_tensors)
        noise = torch.rand(3)
        sd = opt.state_dict()
        fresh = toy_model(seed=7, dtype=torch.float32)
        opt2 = MasterAdamW(list(fresh.parameters()), dp_group=dist.group.WORLD, bucket_bytes=64)
        assert load_checkpoint(path, optimizer=opt2) == {"step": 2}  # this rank's shard and RNG
        assert torch.equal(torch.rand(3), noise)
        sd2 = opt2.state_dict()
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(a, b) for a, b in zip(sd[key], sd2[key]))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        assert not torch.equal(sd["exp_avg"][0], torch.load(
            os.path.join(path, "training_state", f"optimizer-rank{1 - rank}.pt"))["exp_avg"][0])
        dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen under load)
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_their_own_state(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2)
    names = sorted(p.name for p in (tmp_path / "step-2" / "training_state").iterdir())
    assert names == ["optimizer-rank0.pt", "optimizer-rank1.pt", "rng-rank0.pt", "rng-rank1.pt", "trainer.json"]
    assert json.loads((tmp_path / "step-2" / "training_state" / "trainer.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


def test_full_disk_is_one_clear_error_and_the_previous_checkpoint_stays_loadable(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from areno.training import checkpoint

    root = tmp_path / "ckpts"
    model = toy_model()
    save_checkpoint(root / "step-1", model=model, trainer_state={"step": 1}, save_model_fn=save_tensors)
    size = checkpoint.folder_bytes(root / "step-1")
    # 1) the space check before writing: nothing is written
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(DiskFullError) as info:
        save_checkpoint(root / "step-2", model=model, trainer_state={"step": 2}, save_model_fn=save_tensors)
    msg = str(info.value)
    assert "\n" not in msg and str(root / "step-2") in msg and f"{size} bytes" in msg and "has 100 bytes free" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    monkeypatch.undo()

    # 2) the disk fills up during the write (torch.save's own message names neither disk nor path)
    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 982")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(DiskFullError, match=r"disk filled up while saving checkpoint .*step-1: it needs about"):
        save_checkpoint(root / "step-1", model=model, trainer_state={"step": 9}, save_model_fn=save_tensors)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    assert load_checkpoint(root / "step-1", rng=False) == {"step": 1}


def test_rank_state_round_trip(tmp_path):
    import random

    model = toy_model()
    gen = random.Random(5)
    gen.random()
    path = save_checkpoint(tmp_path / "step-1", model=model, trainer_state={"step": 1}, save_model_fn=save_tensors,
                           rank_state={"engine_rng": gen.getstate()})
    state = load_checkpoint(path, rng=False)
    again = random.Random()
    version, internal, gauss = state["rank_state"]["engine_rng"]
    again.setstate((version, tuple(internal), gauss))
    assert [again.random() for _ in range(3)] == [gen.random() for _ in range(3)]

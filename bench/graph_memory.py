"""Where the graphed training step's memory goes (a diagnostic for ``--train-cuda-graphs``; nothing is saved).

    python bench/graph_memory.py                 # GPU: the tiny model of tests/training/test_train_graphs_gpu.py
    python bench/graph_memory.py --shape t1      # GPU: the Qwen3-0.6B shape at T1's layout (8 x 1024)

Runs the same update eagerly and with CUDA graphs (one microbatch, the "own" gradient mode) and prints, for each,
the reserved / allocated peak of a steady-state step; for the graphed trainer also the memory after each capture
(forward, backward, optimizer graph) and the caching allocator's segments grouped by pool: the graphs' private pool
against the ordinary one, with each pool's reserved and still-allocated bytes and its largest live blocks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)


def pools(top: int = 5) -> None:
    """Segments of the caching allocator by pool id: reserved, allocated, largest live blocks."""
    seg = defaultdict(lambda: [0, 0, []])
    for s in torch.cuda.memory_snapshot():
        key = tuple(s.get("segment_pool_id", (0, 0)))
        seg[key][0] += s["total_size"]
        seg[key][1] += s["allocated_size"]
        seg[key][2] += [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"]
    for key, (total, alloc, blocks) in sorted(seg.items()):
        big = ", ".join(f"{b / MiB:.1f}" for b in sorted(blocks, reverse=True)[:top])
        print(f"    pool {key}: reserved {total / MiB:8.1f} MiB, allocated {alloc / MiB:8.1f} MiB, "
              f"{len(blocks)} live blocks (largest MiB: {big})")


def rows_of(lengths, vocab, seed):
    from areno.training.batch import Row

    g = torch.Generator().manual_seed(seed)
    return [Row(prompt_ids=torch.randint(1, vocab, (5,), generator=g).tolist(),
                response_ids=torch.randint(1, vocab, (n - 5,), generator=g).tolist()) for n in lengths]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["tiny", "t1"], default="tiny")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("graph_memory: needs a CUDA device", file=sys.stderr)
        return 2
    from areno.models import load_model
    from areno.rl.algorithms import sft_loss_fn
    from areno.testing import make_tiny_checkpoint
    from areno.training.optimizer import MasterAdamW
    from areno.training.schedule import LRSchedule
    from areno.training.trainer import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "tiny":
            ckpt, vocab = make_tiny_checkpoint(os.path.join(tmp, "q"), "qwen3", seed=0, **TINY), 1000
        else:
            import models  # bench/models.py: the Qwen3-0.6B-shaped random checkpoint

            ckpt = models.checkpoint(False)
            vocab = None
        for mode in ("off", "on"):
            model = load_model(ckpt, dtype=torch.bfloat16, device="cuda").train()
            model.set_activation_checkpointing(False)
            v = vocab or model.config.vocab_size
            rows = rows_of([1024] * 8, min(v, 50000), seed=7)
            opt = MasterAdamW(list(model.parameters()), lr=1e-3)
            trainer = PolicyTrainer(model, opt, LRSchedule(1e-3), train_cuda_graphs=mode)
            print(f"== graphs {mode}: parameters + optimizer state "
                  f"{torch.cuda.memory_allocated() / MiB:.1f} MiB allocated")
            if trainer.graphs is not None:
                g = trainer.graphs
                for name in ("_forward_body", "_backward_body", "_optimizer_body"):
                    real = getattr(g, name)

                    def traced(*a, _real=real, _name=name):
                        _real(*a)
                        capturing = torch.cuda.is_current_stream_capturing()
                        print(f"  after {_name}{' (capture)' if capturing else ' (warm-up)'}: "
                              f"allocated {torch.cuda.memory_allocated() / MiB:.1f} MiB, "
                              f"reserved {torch.cuda.memory_reserved() / MiB:.1f} MiB")

                    setattr(g, name, traced)
            for _ in range(3):
                trainer.train(rows, sft_loss_fn(), 8, 1)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            trainer.train(rows, sft_loss_fn(), 8, 1)
            torch.cuda.synchronize()
            print(f"  steady step: peak reserved {torch.cuda.max_memory_reserved() / MiB:.1f} MiB, peak allocated "
                  f"{torch.cuda.max_memory_allocated() / MiB:.1f} MiB, now reserved "
                  f"{torch.cuda.memory_reserved() / MiB:.1f} MiB")
            pools()
            if trainer.graphs is not None:
                trainer.graphs.close()
            del trainer, opt, model
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

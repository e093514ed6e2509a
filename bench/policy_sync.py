"""S1 policy sync: how fast split mode streams the policy from the train partition to the rollout partition.

Two measurements, random weights in bf16 (fp32 with --smoke), Qwen3-0.6B and an 8B dense shape:

- ``--pack-only`` (one process, one GPU or the CPU): the pack/unpack cost alone, i.e. walking the trainer's tensors
  into byte buckets (``policy_sync.pack``) and copying each bucket's tensors in place into a second model's
  parameters (``PolicyReceiver``'s copy), per bucket size; reported as seconds and GB/s of policy.
- default (two processes: train rank on GPU 0, rollout rank on GPU 1, or two CPU slots with gloo): whole syncs
  through ``PolicyPublisher.publish`` / ``PolicyReceiver.receive`` per bucket size (16 / 64 / 256 / 1024 MiB),
  seconds per sync, GB/s, and the fraction of a plain broadcast of one tensor of the same size measured in the same
  run (the link's limit).

    python bench/policy_sync.py --pack-only            # one GPU
    python bench/policy_sync.py                        # two GPUs (nvidia-h200-x2)
    python bench/policy_sync.py --smoke [--pack-only]  # tiny shape, CPU, seconds

Results go to bench/results/policy_sync.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import append_jsonl, env_info, print_table  # noqa: E402
from bench.models import QWEN3_06B, QWEN3_8B, SMOKE, random_model  # noqa: E402

SHAPES = {"0.6b": QWEN3_06B, "8b": QWEN3_8B, "smoke": SMOKE}
BUCKETS_MIB = (16, 64, 256, 1024)


def sync_time(fn, device, iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first one allocates buffers


# ---- pack/unpack alone (one process) ---------------------------------------------------------------------------
@torch.no_grad()
def round_trip(model, plan, where, buffer, targets) -> None:
    """Pack every tensor into its bucket; each full bucket is unpacked into the receiving model at once."""
    from areno.rl.rollout.policy_sync import pack, policy_tensors, unpack

    filled = [0] * len(plan)
    for hf_name, tensor in policy_tensors(model):
        b, entry = where[hf_name]
        pack(buffer, entry, tensor)
        filled[b] += 1
        if filled[b] == len(plan[b]):  # where a bucket would be broadcast
            for e in plan[b]:
                full = unpack(buffer, e)
                for param, d, s in targets[e.name]:
                    param[d].copy_(full[s])


def pack_only(args, device, dtype) -> list[dict]:
    from areno.models.tp import pieces
    from areno.rl.rollout.policy_sync import bucket_size, hf_specs, plan_buckets

    rows = []
    for name in args.shapes:
        src = random_model(SHAPES[name], dtype, device, seed=0)
        dst = random_model(SHAPES[name], dtype, device, seed=1)
        params = dict(dst.named_parameters())
        targets = {}
        for pname, lays in dst._tp_layouts.items():
            for pc in pieces(lays, 0, 1):
                targets.setdefault(pc.hf_name, []).append((params[pname], pc.dst, pc.src))
        for mib in args.buckets:
            plan = plan_buckets(hf_specs(src), int(mib * 2**20))
            where = {e.name: (b, e) for b, bucket in enumerate(plan) for e in bucket}
            buffer = torch.empty(max(bucket_size(b) for b in plan), dtype=torch.uint8, device=device)
            total = sum(bucket_size(b) for b in plan)

            seconds = sync_time(functools.partial(round_trip, src, plan, where, buffer, targets), device,
                                args.iters)
            same = all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
            rows.append({"mode": "pack+unpack", "shape": name, "bucket_mib": mib, "buckets": len(plan),
                         "gbytes": total / 1e9, "seconds": seconds, "gbps": total / seconds / 1e9,
                         "s_per_gb": seconds / (total / 1e9), "exact": same})
        del src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- whole syncs between two ranks -----------------------------------------------------------------------------
def broadcast_and_wait(tensor, group) -> None:
    dist.broadcast(tensor, src=0, group=group)
    dist.barrier(group)


def publish_and_wait(publisher, group) -> None:
    publisher.publish()
    dist.barrier(group)


def receive_and_wait(receiver, group) -> None:
    receiver.receive()
    dist.barrier(group)


def two_ranks(args, dtype) -> list[dict] | None:
    from areno.distributed import parallel
    from areno.rl.rollout.policy_sync import PolicyPublisher, PolicyReceiver

    rank = int(os.environ["RANK"])
    device_index = rank if torch.cuda.is_available() else None
    layout = parallel.init_split(1, 1, 1, device=device_index)
    device = torch.device("cuda", rank) if device_index is not None else torch.device("cpu")
    rows = []
    for name in args.shapes:
        model = random_model(SHAPES[name], dtype, device, seed=rank)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        big = torch.empty(total, dtype=torch.uint8, device=device)
        plain = sync_time(functools.partial(broadcast_and_wait, big, layout.control), device, args.iters)
        del big
        for mib in args.buckets:
            if rank == 0:
                side = PolicyPublisher(model, layout, int(mib * 2**20))
                box = [(side.plan, side.owner)]
            else:
                side, box = PolicyReceiver(model, layout), [None]
            dist.broadcast_object_list(box, src=0, group=layout.control)
            if rank != 0:
                side.receive(*box[0])  # the first sync also sends the plan
                step = functools.partial(receive_and_wait, side, layout.control)
            else:
                side.publish()
                step = functools.partial(publish_and_wait, side, layout.control)
            seconds = sync_time(step, device, args.iters)
            if rank == 0:
                nbytes = side.nbytes
                rows.append({"mode": "sync", "shape": name, "bucket_mib": mib, "buckets": len(side.plan),
                             "gbytes": nbytes / 1e9, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                             "plain_broadcast_s": plain, "plain_gbps": total / plain / 1e9,
                             "of_plain": plain / seconds})
        if rank != 0:  # the last sync must have made the rollout model the trainer's exactly
            ref = random_model(SHAPES[name], dtype, device, seed=0)
            assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters())), "sync not exact"
            del ref
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    parallel.destroy_distributed()
    return rows if rank == 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack-only", action="store_true", help="one process: the pack/unpack cost alone")
    p.add_argument("--smoke", action="store_true", help="tiny shape in fp32 (CPU-friendly)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    p.add_argument("--buckets", nargs="+", type=float, default=list(BUCKETS_MIB), help="bucket sizes in MiB")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    args.shapes = args.shapes or (["smoke"] if args.smoke else ["0.6b", "8b"])
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.pack_only:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        rows = pack_only(args, device, dtype)
    elif "RANK" not in os.environ:  # start the two ranks (train, rollout) with torch's launcher
        from areno.distributed.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", __file__, *sys.argv[1:]]
        return subprocess.run(cmd).returncode
    else:
        rows = two_ranks(args, dtype)
        if rows is None:
            return 0
    print_table(rows, [c for c in ("mode", "shape", "bucket_mib", "buckets", "gbytes", "seconds", "gbps", "s_per_gb",
                                   "plain_gbps", "of_plain", "exact") if any(c in r for r in rows)])
    append_jsonl("policy_sync", rows, env_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())

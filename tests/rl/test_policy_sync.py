"""Policy streaming's pieces: the bucket plan, byte packing and the in-place copy into a model's own TP slice."""

import pytest
import torch

from areno.models import load_model
from areno.models.saver import iter_hf_tensors
from areno.models.tp import pieces
from areno.rl.rollout.policy_sync import ALIGN, bucket_size, hf_specs, pack, plan_buckets, unpack
from areno.testing import make_tiny_checkpoint


def test_plan_keeps_order_alignment_and_the_bucket_cap():
    specs = [("a", (3, 5), torch.float32), ("b", (7,), torch.bfloat16), ("c", (100, 100), torch.float32),
             ("d", (1,), torch.int64)]
    plan = plan_buckets(specs, bucket_bytes=256)
    names = [e.name for bucket in plan for e in bucket]
    assert names == ["a", "b", "c", "d"]
    assert all(e.offset % ALIGN == 0 for bucket in plan for e in bucket)
    big = next(b for b in plan if b[0].name == "c")
    assert len(big) == 1 and bucket_size(big) == 40000  # larger than a bucket: one of its own
    assert all(bucket_size(b) <= 256 for b in plan if b is not big)


def round_trip(device, dtype, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    src = load_model(ckpt, dtype=dtype, device=device)
    dst = load_model(ckpt, dtype=dtype, device=device)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    plan = plan_buckets(hf_specs(src), bucket_bytes=4096)
    where = {e.name: e for bucket in plan for e in bucket}
    buffer = torch.full((sum(bucket_size(b) for b in plan),), 255, dtype=torch.uint8, device=device)
    base = {}
    start = 0
    for bucket in plan:
        for e in bucket:
            base[e.name] = start
        start += bucket_size(bucket)
    params = dict(dst.named_parameters())
    for name, tensor in iter_hf_tensors(src):
        e = where[name]
        view = buffer[base[name] :]
        pack(view, e, tensor)
        assert torch.equal(unpack(view, e), tensor)
    for pname, lays in dst._tp_layouts.items():
        for pc in pieces(lays, 0, 1):
            with torch.no_grad():
                params[pname][pc.dst].copy_(unpack(buffer[base[pc.hf_name] :], where[pc.hf_name])[pc.src])
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_pack_and_unpack_round_trip_every_tensor_exactly(tmp_path):
    round_trip(torch.device("cpu"), torch.float32, tmp_path)


@pytest.mark.gpu
def test_pack_and_unpack_round_trip_bf16_on_the_gpu(tmp_path):
    round_trip(torch.device("cuda"), torch.bfloat16, tmp_path)

"""The vectorised pack() against a plain per-token list reference, over random rows with every optional field (loss
masks, token advantages, per-token and per-row extras, tensors made ahead of the update), and its refusals."""

import random

import pytest
import torch

from areno.training.batch import Row, pack, row_tensors


def reference_pack(rows: list[Row]) -> dict:
    """The packed layout built token by token in lists (the module doc's definition)."""
    ids, pos, tgt, seq, old, adv, cu = [], [], [], [], [], [], [0]
    for i, r in enumerate(rows):
        P, R = len(r.prompt_ids), len(r.response_ids)
        ids += list(r.prompt_ids) + list(r.response_ids)
        pos += range(P + R)
        mask = r.loss_mask if r.loss_mask is not None else [1] * R
        tgt += [-100] * (P - 1) + [t if m else -100 for t, m in zip(r.response_ids, mask)] + [-100]
        seq += [i] * (P + R)
        old += [0.0] * (P - 1) + list(r.rollout_logprobs) + [0.0]
        token_adv = r.token_advantages if r.token_advantages is not None else [r.advantage] * R
        adv += [0.0] * (P - 1) + list(token_adv) + [0.0]
        cu.append(cu[-1] + P + R)
    out = dict(input_ids=torch.tensor(ids), positions=torch.tensor(pos), targets=torch.tensor(tgt),
               seq_index=torch.tensor(seq), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
               old_logprobs=torch.tensor(old, dtype=torch.float32), advantages=torch.tensor(adv, dtype=torch.float32),
               seq_advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
               max_seqlen=max(len(r) for r in rows), num_rows=len(rows))
    out["mask"] = (out["targets"] != -100).float()
    spread = lambda r, k: [0.0] * (len(r.prompt_ids) - 1) + list(r.extras[k]) + [0.0]  # noqa: E731
    out["tok"] = {k: torch.tensor([x for r in rows for x in spread(r, k)], dtype=torch.float32)
                  for k, v in rows[0].extras.items() if isinstance(v, list)}
    out["row"] = {k: torch.tensor([float(r.extras[k]) for r in rows], dtype=torch.float32)
                  for k, v in rows[0].extras.items() if not isinstance(v, list)}
    return out


def random_rows(rng, n, *, masks=False, token_adv=False, extras=False, tensors=False):
    rows = []
    for i in range(n):
        P, R = rng.randint(1, 11), rng.randint(0, 9)
        r = Row([rng.randrange(50_000) for _ in range(P)], [rng.randrange(50_000) for _ in range(R)],
                [-rng.random() * 5 for _ in range(R)], advantage=rng.gauss(0, 1), reward=rng.random())
        if masks and i % 3:
            r.loss_mask = [rng.randint(0, 1) for _ in range(R)]
        if token_adv and i % 2:
            r.token_advantages = [rng.gauss(0, 1) for _ in range(R)]
        if extras:
            r.extras = {"ref": [rng.gauss(0, 1) for _ in range(R)], "score": rng.random()}
        if tensors and i % 2 == 0:
            r.ids_tensor, r.logprobs_tensor = row_tensors(r.prompt_ids, r.response_ids, r.rollout_logprobs)
        rows.append(r)
    return rows


@pytest.mark.parametrize("kind", [{}, {"masks": True}, {"token_adv": True}, {"extras": True}, {"tensors": True},
                                  {"masks": True, "token_adv": True, "extras": True, "tensors": True}])
def test_pack_equals_the_per_token_reference(kind):
    rng = random.Random(str(kind))
    for _ in range(25):
        rows = random_rows(rng, rng.randint(1, 7), **kind)
        got, want = pack(rows), reference_pack(rows)
        for key, value in want.items():
            have = getattr(got, key)
            if isinstance(value, torch.Tensor):
                assert have.dtype == value.dtype and torch.equal(have, value), key
            elif isinstance(value, dict):
                assert have.keys() == value.keys() and all(torch.equal(have[k], value[k]) for k in value), key
            else:
                assert have == value, key


def test_rows_without_logprobs_pack_without_old_logprobs():
    rows = random_rows(random.Random(1), 3)
    rows[1].rollout_logprobs = None
    assert pack(rows).old_logprobs is None


def test_pack_refuses_misaligned_rows():
    rng = random.Random(2)
    with pytest.raises(ValueError, match="at least one row"):
        pack([])
    with pytest.raises(ValueError, match="prompt token"):
        pack([Row([], [1, 2], [0.0, 0.0])])
    row = random_rows(rng, 1)[0]
    row.response_ids = row.response_ids + [7]  # one more token than log-probs
    with pytest.raises(ValueError, match="rollout_logprobs has"):
        pack([row])
    row = random_rows(rng, 1)[0]
    row.ids_tensor = torch.zeros(len(row) + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="ids_tensor has"):
        pack([row])


@pytest.mark.gpu
def test_packed_to_cuda_goes_through_pinned_memory_and_keeps_every_value():
    rows = random_rows(random.Random(3), 5, extras=True, tensors=True)
    host = pack(rows)
    dev = host.to("cuda")
    torch.cuda.synchronize()
    for key, value in vars(host).items():
        if isinstance(value, torch.Tensor):
            assert getattr(dev, key).is_cuda and torch.equal(getattr(dev, key).cpu(), value), key
    assert not host.input_ids.is_pinned()  # the caller's tensors are left as they were


def test_tensors_travel_in_one_buffer_and_keep_every_value():
    """Packed.to's GPU path (here with a CPU target: no pinning): every CPU tensor, in the fields and in the extras
    dicts, becomes a view of one 16-byte-slotted buffer, with its dtype, shape and values; other values pass."""
    from areno.training.batch import _to_gpu_together

    fields = {"a": torch.arange(7, dtype=torch.int64), "b": torch.tensor([True, False, True]),
              "c": torch.randn(3, 5).t(), "e": torch.empty(0, 4), "n": None, "k": 3,
              "tok": {"x": torch.randn(11, dtype=torch.float32), "y": torch.arange(2, dtype=torch.int32)}, "row": {}}
    out = _to_gpu_together(fields, torch.device("cpu"))
    tensors = [out["a"], out["b"], out["c"], out["e"], out["tok"]["x"], out["tok"]["y"]]
    base = out["a"].untyped_storage().data_ptr()
    for got, want in zip(tensors, [fields["a"], fields["b"], fields["c"], fields["e"], *fields["tok"].values()]):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == base and (got.data_ptr() - base) % 16 == 0
    assert out["n"] is None and out["k"] == 3 and out["row"] == {} and fields["tok"]["x"] is not out["tok"]["x"]

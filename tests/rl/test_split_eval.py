"""--eval-dataset-path in split mode (issue 43): the rollout ranks sample the sets with their own per-prompt seeds,
after the sync of the step's weights, and train rank 0 scores and logs them; a split run with evaluation trains
exactly as one without (losses, rewards, weights), on-policy (--max-staleness 0) and async (K = 1, the batch in flight
left as it is; the policy version evaluated is logged). What is not built is refused naming the flag."""

import pytest
import torch
from safetensors.torch import load_file

from areno.config import ConfigError, TrainConfig
from tests.helpers.split_runs import areno, metrics, needs_gpus

pytestmark = needs_gpus(2)
three_gpus = needs_gpus(3)
SPLIT = ["--train-devices", "0", "--rollout-devices", "1"]
TRAINING = ("loss", "reward_mean", "reward_std", "grad_norm", "policy_version", "staleness_max")


@pytest.fixture(scope="module")
def eval_set(files, tmp_path_factory):
    _, data, _ = files
    path = tmp_path_factory.mktemp("evalset") / "sums.jsonl"
    path.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))
    return path


def with_eval(eval_set):
    return ["--eval-dataset-path", f"sums={eval_set}", "--eval-interval", "2", "--eval-n-samples", "3"]


def same_training(a, b, *, steps):
    """Every training metric at every step of ``b``'s ``steps`` (``a`` may run longer), and the weights at the last
    of them, bit for bit."""
    ta = {m["step"]: m for m in metrics(a) if "loss" in m and m["step"] <= steps}
    tb = {m["step"]: m for m in metrics(b) if "loss" in m}
    assert sorted(ta) == sorted(tb) == list(range(1, steps + 1))
    for step in ta:
        differ = {k: (ta[step].get(k), tb[step].get(k)) for k in TRAINING if ta[step].get(k) != tb[step].get(k)}
        assert not differ, f"step {step}: {differ}"
    wa, wb = (load_file(str(d / f"step-{steps}" / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def evals(out) -> dict:
    return {m["step"]: m for m in metrics(out) if "eval/sums/avg@3" in m}


@pytest.fixture(scope="module")
def sync_eval(files, eval_set, tmp_path_factory):
    out = tmp_path_factory.mktemp("synceval") / "run"
    return out, areno(files, out, *SPLIT, "--max-staleness", "0", *with_eval(eval_set))


def check_evals(out, proc, *, versions: bool):
    got = evals(out)
    assert sorted(got) == [0, 2, 3]  # before, --eval-interval 2, after the last step
    for step, r in got.items():
        assert {"eval/sums/pass@1", "eval/sums/pass@3", "eval/sums/maj@3", "eval/sums/avg@3_lo",
                "eval/sums/avg@3_hi"} <= set(r)
        assert r["eval/sums/pass@1"] == pytest.approx(r["eval/sums/avg@3"])
        assert r["eval/sums/avg@3_lo"] <= r["eval/sums/avg@3"] <= r["eval/sums/avg@3_hi"]
        # async: evaluated with the weights of every step trained so far (synced first); on-policy: not logged
        assert r.get("eval/sums/policy_version") == (step if versions else None)
    assert "eval step 2" in proc.stdout


def test_on_policy_split_run_with_evaluation_trains_exactly_as_one_without(on_policy_split, sync_eval):
    plain = on_policy_split  # the session's on-policy split run (tests/rl/conftest.py)
    same_training(plain, sync_eval[0], steps=3)
    check_evals(*sync_eval, versions=False)
    assert not any(k.startswith("eval/") for m in metrics(plain) for k in m)


def test_async_split_run_with_evaluation_trains_exactly_as_one_without(files, eval_set, async_split, tmp_path):
    plain, evald = async_split, tmp_path / "evald"  # the session's async split run: its first 3 of 4 steps
    proc = areno(files, evald, *SPLIT, "--max-staleness", "1", *with_eval(eval_set))
    same_training(plain, evald, steps=3)
    assert [m["staleness_max"] for m in metrics(plain)][:3] == [0, 1, 1]  # a batch was in flight at each evaluation
    check_evals(evald, proc, versions=True)


@pytest.fixture(scope="module")
def colocated_eval(files, eval_set, tmp_path_factory):
    out = tmp_path_factory.mktemp("coloeval") / "run"
    areno(files, out, *with_eval(eval_set))
    return out


def same_evals(a, b):
    a, b = evals(a), evals(b)
    assert sorted(a) == sorted(b) == [0, 2, 3]
    for step in a:
        assert {k: v for k, v in a[step].items() if k.startswith("eval/")} == {
            k: v for k, v in b[step].items() if k.startswith("eval/")}, step


def test_split_evaluation_samples_as_the_colocated_one(colocated_eval, sync_eval):
    """On-policy split trains as colocated, and the same per-prompt seeds give the same samples: every evaluation's
    metrics agree with the colocated run's (a set is the same evaluation wherever it runs)."""
    same_evals(colocated_eval, sync_eval[0])


@pytest.mark.slow  # three ranks each
@three_gpus
@pytest.mark.parametrize("rollout", [["1..2", "--rollout-tp-size", "2"], ["1,2", "--rollout-tp-size", "1"]],
                         ids=["tp2-engine", "two-engines"])
def test_split_evaluation_over_tp_or_several_engines_equals_the_colocated_one(files, eval_set, colocated_eval,
                                                                              tmp_path, rollout):
    """One command per rollout group, each engine its share of the prompts (a TP engine's ranks run it together):
    each prompt's own seed makes the result independent of the spread."""
    out = tmp_path / "run"
    areno(files, out, "--train-devices", "0", "--rollout-devices", *rollout, *with_eval(eval_set))
    same_evals(colocated_eval, out)


@pytest.mark.parametrize("extra", [dict(partial_rollout=True, max_staleness=1), dict(agent_fn="{reward}")],
                         ids=["partial-rollout", "agentic"])
def test_split_evaluation_not_built_is_refused_naming_the_flag(files, eval_set, extra):
    ckpt, data, reward = files
    extra = {k: v.format(reward=reward) if isinstance(v, str) else v for k, v in extra.items()}
    with pytest.raises(ConfigError) as e:
        TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), train_devices=[0],
                    rollout_devices=[1], eval_dataset_path=[f"sums={eval_set}"], **extra)
    assert e.value.flag == "--eval-dataset-path"


def test_eval_line_names_the_policy_version():
    from areno.rl.eval_schedule import eval_line

    line = eval_line(4, {"eval/s/avg@2": 0.5, "eval/s/avg@2_lo": 0.25, "eval/s/avg@2_hi": 0.75,
                         "eval/s/policy_version": 4})
    assert line == "eval step 4 (policy version 4): s avg@2 50.0% [25.0,75.0]"

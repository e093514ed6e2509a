"""The algorithms ``--algo`` names: one module per step, and the registry the loop and the set-up read.

Each entry is an ``Algorithm`` (base.py): its ``step(ctx, batch, upcoming=None) -> metrics`` and its capabilities
(needs_reward, needs_ref, uses_critic, responses, prompt_optional). The loop calls
``ALGORITHMS[cfg.algo].step`` and branches on nothing else.

Adding an algorithm is one new module and one registry line. For example REINFORCE with a batch-mean baseline,
sharing GRPO's policy-gradient step with its own loss (``rl/algorithms/reinforce.py``)::

    from areno.rl.algorithms.base import Algorithm
    from areno.rl.algorithms.grpo import policy_step
    from areno.rl.losses import policy_loss
    from areno.training.loss import LossFn


    def reinforce_loss(cfg) -> LossFn:
        def fn(out, packed, norms):  # no clipping: the plain score-function estimator
            return policy_loss(out.logprobs, out.logprobs.detach(), packed.advantages, packed.mask,
                               packed.seq_index, num_rows=packed.num_rows, norm=norms.num_tokens,
                               clip_low=float("inf"), clip_high=float("inf"))
        return LossFn(fn)


    def step(ctx, batch, upcoming=None) -> dict:
        return policy_step(ctx, batch, upcoming, loss_fn=reinforce_loss(ctx.cfg))


    STEP = Algorithm(step, needs_reward=True)

and here ``"reinforce": reinforce.STEP,`` in ``ALGORITHMS`` (plus the name in the config's algorithm choices, so
``--algo reinforce`` parses).
"""

from areno.rl.algorithms import dpo, grpo, ppo, sft
from areno.rl.algorithms.base import Algorithm, StepContext, normalise, updates_per_step
from areno.rl.algorithms.loss_fns import (
    InlineProximal,
    dpo_loss_fn,
    grpo_loss_fn,
    gspo_loss_fn,
    inline_proximal,
    sft_loss_fn,
)

ALGORITHMS: dict[str, Algorithm] = {
    "sft": sft.STEP,
    "dpo": dpo.STEP,
    "grpo": grpo.GRPO,
    "gspo": grpo.GSPO,
    "ppo": ppo.STEP,
}

# the losses the SDK's ``Trainer.train(loss_fn=NAME)`` names, each built from the TrainConfig
LOSSES = {"sft": lambda cfg: sft_loss_fn(), "grpo": grpo_loss_fn, "gspo": gspo_loss_fn}

__all__ = ["ALGORITHMS", "LOSSES", "Algorithm", "InlineProximal", "StepContext", "dpo_loss_fn", "grpo_loss_fn",
           "gspo_loss_fn", "inline_proximal", "normalise", "sft_loss_fn", "updates_per_step"]

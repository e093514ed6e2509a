"""The ``agentic-quickstart`` preset: a tiny model areno creates itself learns to use a tool, through an SFT warm-up on
a teacher's imperfect tool-use demonstrations, then multi-turn GRPO through an agent that runs the tool. No download,
no GPU.

The story (see ``agentic_task.py``): sums of two 7-digit numbers, which a tiny model cannot compute but an ``add``
tool can. An episode is a conversation: the model calls the tool, the agent (``run_agent``, over the rollout's local
OpenAI endpoint) runs it and sends the result back, the model answers; the reward is 1 for the exact sum. The
teacher skips the tool in 70% of its first turns and answers with an estimate (``about 5800000``), so after the
warm-up the model estimates every held-out problem when decoding greedily (no exact sum), while sampling still calls
the tool in about 30% of its episodes. GRPO through the agent moves the model onto the tool: held-out success (200
problems never trained on, each one greedy episode through the agent) goes from none to nearly all.

The model is the quickstart's layout, created once (random weights from a fixed seed, the byte-level tokenizer of
``areno.testing``) and cached under ``$ARENO_HOME/agentic-quickstart/`` (default
``~/.cache/areno/agentic-quickstart/``). Every flag given on the command line still overrides the preset's value,
e.g. ``--max-steps 6``, ``--seed 1`` or ``--dataset-path teacher_skips=0`` (a teacher who always calls the tool).
"""

from __future__ import annotations

from pathlib import Path

from areno.config import TrainConfig
from areno.presets import register_preset
from areno.quickstart.preset import MODEL, cached_model, cpu_threads

NAME = "agentic-quickstart"
TASK = Path(__file__).resolve().with_name("agentic_task.py")
# The quickstart's model layout (preset.MODEL). Bump MODEL_VERSION with any change to it: it names the cache folder,
# so an old cached model is never reused.
MODEL_VERSION = "add-tool-v1"


def cache_dir() -> Path:
    from areno.platform import areno_home

    return areno_home() / NAME


def model_path() -> Path:
    """The preset's model folder (the quickstart's layout, cached under its own name), created on first use."""
    return cached_model(cache_dir() / f"model-{MODEL_VERSION}", MODEL)


@register_preset(NAME)
def agentic_quickstart() -> TrainConfig:
    cpu_threads()
    return TrainConfig(
        preset=NAME,
        ckpt=str(model_path()),
        dataset_loader_fn=str(TASK),
        agent_fn=str(TASK),  # run_agent: the episode (tool call, tool result, answer) and its reward
        algo="grpo",
        batch_size=64,
        n_samples=4,
        mini_bs=256,
        lr=1e-3,
        sft_warmup_steps=300,
        sft_warmup_lr=2.5e-3,
        # both stages decay linearly to min_lr: the warm-up ends calm, so the first-token choice between the tool
        # and the estimate (what greedy decoding follows) settles at the teacher's rate instead of the last batch's
        lr_decay_style="linear",
        min_lr=1e-4,
        max_steps=12,
        temperature=1.0,
        max_new_tokens=48,  # per turn: a tool call is 40 tokens with the end of turn
        max_prompt_tokens=112,  # an answer-turn row's prompt (the conversation up to the tool's result) is 100
        activation_checkpointing=False,
        eval_interval=4,
        save_path=f"runs/{NAME}",
        overwrite=True,  # a demo: running it again replaces the last one (an explicit --resume continues it instead)
        tensorboard=False,
        dtype="float32",
    )

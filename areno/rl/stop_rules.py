"""The training loop's stop rules, checked at every step boundary (``TrainLoop``): a signal (SIGTERM/SIGINT on any
train rank), ``--max-reward-failure-steps`` steps in a row where every reward failed, and user code stuck past its
timeout. Each saves the run first (unless the step just did, or there is no ``--save-path``) and stops with one line
that says where the run is kept and what to fix.
"""

from __future__ import annotations

import signal

from areno.config import RunError
from areno.training import plugins


def check_stop(loop, saved: bool) -> None:
    """Once SIGTERM/SIGINT reached any train rank, save (unless this step just did) and stop with one line (every
    train rank agrees on the step)."""
    signum = loop.stop_request.agreed(loop.groups.train_group) if loop.stop_request is not None else 0
    if not signum:
        return
    from areno.distributed.stop import Stopped

    if loop.cfg.save_path and loop.step_index > 0 and not saved:
        loop.save()
    name = signal.Signals(signum).name
    if loop.step_index == 0:
        kept = "before the first step: nothing to save yet"
    elif loop.cfg.save_path:
        kept = f"after step {loop.step_index}: saved at {loop.last_save} (--resume continues from there)"
    else:
        kept = f"after step {loop.step_index}: nothing saved (no --save-path)"
    raise Stopped(signum, f"stopped by {name} {kept}")


def check_reward_failures(loop, m: dict, saved: bool) -> None:
    """Stop (after saving) once every reward of ``--max-reward-failure-steps`` steps in a row failed (counted in
    ``loop.failed_reward_steps``, which checkpoints keep), or when hung plugin calls pile up."""
    cfg = loop.cfg
    if m.get("stuck_calls", 0) >= plugins.STUCK_CALL_LIMIT:  # hung plugin calls: stop before more threads leak
        _stop_stuck(loop, m["stuck_calls"], saved)
    if "samples" not in m or not cfg.max_reward_failure_steps:
        return
    all_failed = m["samples"] > 0 and m["reward_failures"] >= m["samples"]
    loop.failed_reward_steps = loop.failed_reward_steps + 1 if all_failed else 0
    if loop.failed_reward_steps < cfg.max_reward_failure_steps:
        return
    if cfg.save_path and not saved:
        loop.save()
    n = loop.failed_reward_steps
    kept = f"; the run is saved at {loop.last_save} (fix the reward function, then --resume)" if cfg.save_path \
        else ""
    raise RunError(f"stopping: every reward failed in the last {n} steps (steps {loop.step_index - n + 1}-"
                   f"{loop.step_index}): {_plugins(cfg)} raised, timed out or returned no number on every "
                   f"sample (its first traceback is logged above){kept}")


def _stop_stuck(loop, stuck: int, saved: bool) -> None:
    cfg = loop.cfg
    if cfg.save_path and not saved:
        loop.save()
    kept = f"; the run is saved at {loop.last_save} (fix the hang, then --resume)" if cfg.save_path else ""
    raise RunError(f"stopping after step {loop.step_index}: {stuck} calls of {_plugins(cfg)} are stuck past "
                   f"their timeout, each holding a thread (a blocking call with no timeout of its own?){kept}")


def _plugins(cfg) -> str:
    """The user code that scores samples, for a stop line: the agent and/or the reward function, with timeouts."""
    named = [f"--agent-fn {cfg.agent_fn} (> --agent-timeout-s {cfg.agent_timeout_s:g})"] if cfg.agent_fn else []
    if cfg.reward_fn_path or not named:
        named.append(f"--reward-fn-path {cfg.reward_fn_path} (> --reward-timeout-s {cfg.reward_timeout_s:g})")
    return " or ".join(named)

"""Agentic rollout: multi-turn agents with tools, trained on exactly the tokens the engine sampled.

``--agent-fn FILE`` defines ``async def run_agent(ctx, batch)``. Each (prompt, sample) runs as its own call with a
batch of one item (``batch.iter_samples()``) and its own ``ctx``, on its own thread and event loop (``AgentThread``),
so an agent that raises, hangs past ``--agent-timeout-s`` (in a blocking call too) or returns a reward that is not a
finite number costs that sample (reward 0, logged once, counted), not the run; a turn past ``--max-context-len``
gets a 400 and ends its sample (the turn is not kept). The agent talks to the rollout engine through ``ctx``:

- ``ctx.base_url`` / ``ctx.api_key`` / ``ctx.client(item)``: a local OpenAI-compatible ``/v1/chat/completions``
  endpoint (tools, ``tool_choice``, ``stop``, ``max_tokens``, sampling settings; ``n=1``; non-streaming) on the
  colocated engine; the session is named by the ``X-Areno-Session`` header (``ctx.client(item)`` sets it) or the
  request's ``user`` field;
- ``await ctx.generate(item, prompt_ids, ...)``: the token-level call.

A session is one growing token sequence (``Session``): the first call renders the prompt with the chat template;
each later call renders only the new messages, as the text the template puts after the last sampled token, appended
to the tokens so far; sampled tokens (and their log-probs) are kept as sampled, never decoded and re-encoded. A
history that does not extend the session's (an agent that rewrote or dropped part of it) closes the current
trajectory as a row and starts a new one from the full rendering (a fork, counted in ``agent_forks``). The prefix
cache serves the earlier turns, so a new turn prefills only its delta. Loss masks: sampled tokens 1, everything the
agent or the template adds 0 (tool results 1 with ``--train-tool-results``).
"""

from areno.rl.agentic.rollout import AgentRollout
from areno.rl.agentic.session import (
           SESSION_HEADER,
           AgentBatch,
           AgentContext,
           AgentError,
           AgentItem,
           Generation,
           Session,
)

__all__ = ["SESSION_HEADER", "AgentBatch", "AgentContext", "AgentError", "AgentItem", "AgentRollout", "Generation",
           "Session"]

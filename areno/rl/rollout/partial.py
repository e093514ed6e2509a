"""Partial rollout (--partial-rollout) on a split-mode rollout rank: the engine's sequences live across commands, a
policy sync swaps the weights under them, every token records the policy version that sampled it, and a batch's
long tail may be cut into the next batch (--max-tail-steps).

The train side (remote.RemoteRollout) sends one ``partial`` command per step: the prompts of the batches it sends
ahead, each batch tagged with the step that trains it and each prompt with its key (its dataset index), and the tag of
the batch to finish (``until``). The rank adds the prompts as requests and steps the engine until every prompt group
of that batch has finished (the other batches' sequences decode alongside), and answers with those groups, each
completion carrying ``versions``. Between commands the engine sits at a step boundary: a ``sync`` then swaps the
weights in place (``engine.swap_weights``: prefix cache dropped, the running sequences' K/V kept or recomputed as
--partial-rollout-kv says) and the sequences still running continue under the new policy. The engine's lookahead
(on CUDA) works here as in ``Engine.generate``: a command may end with a decode group of the other batches' rows
queued under the old weights, which the swap reads first, so those tokens (at most ``--decode-steps`` a sequence)
carry the old version.

Cut tail (--max-tail-steps N): once half of the batch's groups have finished, the groups still decoding N decode
rounds later move to the next batch in the engine (they keep decoding; the command that finishes that batch delivers
them). Nothing is cut when no later batch is in the engine. ``drain`` finishes every batch (a checkpoint holds the
rollouts in flight whole: a resumed run and the run that saved continue alike).
"""

from __future__ import annotations

from areno.engine.engine import swap_weights
from areno.engine.model_runner import broadcast_step


class PartialRollout:
    """The rollout rank's side (the engine leader's): batches in flight by tag, each a list of (key, samples)."""

    def __init__(self, engine, *, decode_steps: int, recompute: bool, tail_steps: int, leader: bool = True):
        self.engine, self.decode_steps, self.leader = engine, decode_steps, leader
        self.recompute, self.tail_steps = recompute, tail_steps
        self.version = 0  # the policy version of the engine's weights (every sync says which)
        self.batches: dict[int, list] = {}  # tag -> [(key, [Sequence])], in the order they were added
        self.versions: dict[int, list[int]] = {}  # id(Sequence) -> the version of each of its output tokens
        self.cut = 0  # prompt groups moved to a later batch since the last answer

    def command(self, cmd: dict, index: int, tp_group) -> dict | None:
        """A ``partial`` or ``drain`` command on this rank (engine ``index``): the leader's answer, {"groups": ...,
        "cut": n}; a TP follower executes the leader's steps and answers None."""
        if not self.leader:
            self.engine.follow()
            return None
        if cmd["op"] == "drain":
            groups = self.drain()
        else:
            for tag, shares in cmd["add"]:
                self.add(tag, *shares[index])
            groups = self.run(cmd["until"])
        if tp_group is not None:
            broadcast_step(None, tp_group)  # the followers leave their loop
        answer, self.cut = {"groups": groups, "cut": self.cut}, 0
        return answer

    def add(self, tag: int, prompts: list, options: list, keys: list) -> None:
        groups = self.batches.setdefault(tag, [])
        for prompt, opts, key in zip(prompts, options, keys):
            mm = prompt if hasattr(prompt, "input_ids") else None
            seqs = self.engine.add_request(None if mm is not None else prompt, opts, request_id=key, mm=mm)
            groups.append((key, seqs))
            for s in seqs:
                self.versions[id(s)] = []

    def _stamp(self, batches=None) -> None:
        """Every token sampled since the last stamp (of ``batches``, default all) was sampled under
        ``self.version``."""
        for groups in self.batches.values() if batches is None else batches:
            for _, seqs in groups:
                for s in seqs:
                    v = self.versions[id(s)]
                    v.extend([self.version] * (s.num_output - len(v)))

    def swap(self, load, version: int) -> None:
        """New weights (``load()`` copies them in place) between two steps, sequences in flight. A decode group the
        lookahead queued under the old weights is read first: its tokens are the old version's."""
        self.engine.chains.drain()
        self._stamp()
        swap_weights(self.engine, load, recompute=self.recompute)
        self.version = version

    def run(self, until: int | None) -> list:
        """Step until every group of batch ``until`` has finished (or its tail is cut); its groups as (key,
        [Completion]). None: nothing to finish (the prompts were only added)."""
        target = self.batches.pop(until, []) if until is not None else []
        later = sorted(t for t in self.batches if until is None or t > until)
        done = lambda g: all(s.is_finished for s in g[1])  # noqa: E731
        rounds, tail_from = 0, None
        with self.engine.chains.on(self.decode_steps):  # the next decode group queued before this one is read
            while not all(done(g) for g in target):
                if tail_from is None and 2 * sum(map(done, target)) >= len(target):
                    tail_from = rounds
                if self.tail_steps and later and tail_from is not None and rounds - tail_from >= self.tail_steps:
                    running = [g for g in target if not done(g)]
                    self.batches[later[0]] = running + self.batches[later[0]]  # delivered with the next batch
                    self.cut += len(running)
                    target = [g for g in target if done(g)]
                    break
                self.engine.step(self.decode_steps)
                rounds += 1
        self._stamp([target])
        return [(key, [self._completion(s) for s in seqs]) for key, seqs in target]

    def drain(self) -> dict[int, list]:
        """Finish every batch in flight, in tag order: {tag: its groups}."""
        return {tag: self.run(tag) for tag in sorted(self.batches)}

    def _completion(self, seq):
        c = self.engine.completion(seq)
        c.versions = self.versions.pop(id(seq))
        return c

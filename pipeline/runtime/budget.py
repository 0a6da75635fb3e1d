"""Hardware-aware verification: how many tree tokens a round should verify, from what a forward costs here.

Two ideas, combined:
- **A measured cost curve** (Sequoia, Chen et al. 2024, "hardware-aware tree optimizer": choose the tree size from the
  measured time of one forward of k tokens on the target hardware). `CostCurve.measure` times one target forward over
  k = 1, 2, 4, 8, 16, 32 tree tokens at a realistic cache length; the curve is cached in a small JSON per machine,
  model, dtype, threads and device. On a GPU or a CPU with native bf16 the curve is nearly flat up to 32 tokens; on an
  AVX2-only CPU in bf16 it is steep (0.26 / 1.30 / 5.08 s for k = 1 / 8 / 32).
- **Acceptance statistics per draft source** (dynamic speculation length, e.g. DISCO, Mamou et al. 2024; SpecDec++,
  Huang et al. 2024: stop drafting where the expected gain no longer pays): a running acceptance rate per source
  (schema, hint, history, lookup) — the chance a node is accepted given that its parent was — kept apart for a
  source's first child of a node and for its alternatives (a later sibling from the same source: another call format,
  another enum member). One rate for both counts every rejected alternative against the source's chains (a hint
  proposing its call in three formats, one of them the target's, looks like a gamble at every token); replayed on the
  52 recorded 1.5B outputs of the CPU table, the split saves 3-5% of simulated decode time for toolspec, ooo and the
  oracle alike (a replay like scripts/replay_hints.py, with the old and the new budget).

Each round the full candidate tree is scored: a node's probability of being accepted is its parent's times its
source's rate; expected committed tokens of the best k nodes are 1 + the sum of their probabilities (the bonus token
is always committed). The round verifies the k that maximises expected tokens per second, E(k) / (cost(k) +
overhead). Where k tokens cost about one, that is the whole tree (~32 nodes); where they do not, a few nodes or only
the root (a plain decode step, so a round is never much slower than autoregressive decoding).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .verify import Tree

SIZES = (1, 2, 4, 8, 16, 32)
PRIOR = {1: 0.7, 2: 0.6, 4: 0.4, 8: 0.4, 16: 0.5, 32: 0.4}  # source bit -> prior acceptance (HINT, SCHEMA, ...)
PRIOR_WEIGHT = 4.0
ALT_PRIOR_SHARE = 0.5  # an alternative's prior rate: this share of its source's first-child prior
EXPLORE_EVERY = 8  # rounds: while only the root pays, verify the best node anyway now and then to keep learning


def cost_dir() -> Path:
    return Path(os.environ.get("OOO_COST_DIR") or Path.home() / ".cache" / "ooo-spec" / "cost")


@dataclass
class CostCurve:
    """Seconds of one target forward of k tree tokens, for k in `sizes` (linear in between, flat beyond)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    meta: dict = field(default_factory=dict)

    def cost(self, k: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if k <= sizes[0]:
            return secs[0]
        for (a, sa), (b, sb) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if k <= b:
                return sa + (sb - sa) * (k - a) / (b - a)
        return secs[-1] * k / sizes[-1]

    def as_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": [round(s, 5) for s in self.seconds], "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls(tuple(d["sizes"]), tuple(d["seconds"]), d.get("meta", {}))

    @classmethod
    def flat(cls) -> CostCurve:
        """Every size costs the same (an accelerator's ideal): the budget then takes the whole tree."""
        return cls(SIZES, tuple(1.0 for _ in SIZES), {"kind": "flat"})

    @classmethod
    def measure(cls, target, past: int = 512, reps: int = 3, sizes: tuple[int, ...] = SIZES) -> CostCurve:
        """Time one verify of k tree tokens after a `past`-token cache on `target` (fastest of `reps`); any backend
        of the `TargetBackend` protocol (transformers, llama.cpp). The prefill of that cache is timed too (meta
        `prefill_s`, the faster of two: the first also warms the backend up): `backend: auto` predicts prefills
        from it."""
        from .clock import clock_of

        clock = clock_of(target)  # on a GPU a forward returns at launch: read the time after the device finished
        vocab = len(target.tokenizer)
        ids = [(i * 7919) % min(vocab - 1, 30000) + 1 for i in range(past)]
        prefills = []
        for _ in range(2):
            t0 = clock.now()
            target.prefill(ids, prefix_cache=False)  # a synthetic prompt: never stored for real requests
            prefills.append(clock.now() - t0)
        out = []
        for k in (sizes[-1],) + tuple(sizes):  # the first forward of the largest size is a warm-up
            times = []
            for _ in range(reps):
                parents = [-1] + [0 if i < 3 else i - 1 for i in range(1, k)]  # a small fan-out, then a chain
                depths = [0] * k
                for i in range(1, k):
                    depths[i] = depths[parents[i]] + 1
                tree = Tree(tokens=ids[:k], parents=parents, depths=depths, sources=[0] * k)
                t0 = clock.now()
                target.verify(tree)  # what a round pays: the forward and the argmax of every node
                times.append(clock.now() - t0)
                target.drop(k)
            out.append(min(times))  # other work on the machine only ever adds time: the minimum is the cost
        return cls(tuple(sizes), tuple(out[1:]), {"past": past, "reps": reps, "prefill_s": min(prefills)})

    @classmethod
    def cached(cls, target, key: dict, past: int = 512, reps: int = 3) -> CostCurve:
        """The curve for `key` (machine, model, dtype, threads, device) from the JSON cache, measured if absent."""
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = cost_dir() / f"{digest}.json"
        if path.is_file():
            try:
                curve = cls.from_dict(json.loads(path.read_text()))
                if "prefill_s" in curve.meta:  # curves cached before the prefill was timed are measured again
                    return curve
            except (ValueError, KeyError):
                pass  # a corrupt file is measured again
        curve = cls.measure(target, past, reps)
        curve.meta.update(key=key, measured=time.strftime("%Y-%m-%d %H:%M:%S"))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(curve.as_dict(), indent=1))
        tmp.replace(path)
        return curve


class Acceptance:
    """Running acceptance rates per draft source bit: P(node accepted | its parent accepted), for a source's first
    child of a node (`rate(sources)`) and for its later children there (`rate(sources, alt=True)`: alternatives
    the source ranked below its first choice)."""

    def __init__(self, prior: dict[int, float] | None = None, weight: float = PRIOR_WEIGHT,
                 alt_prior: dict[int, float] | None = None):
        prior = prior or PRIOR
        alt_prior = alt_prior or {b: p * ALT_PRIOR_SHARE for b, p in prior.items()}
        self.acc = {(b, alt): (alt_prior if alt else prior)[b] * weight for b in prior for alt in (False, True)}
        self.tries = {key: weight for key in self.acc}

    def rate(self, sources: int, alt: bool | int = 0) -> float:
        """The best rate among the node's source bits; `alt`: the bits for which the node is an alternative (not its
        source's first child of the parent; True: all of them)."""
        bits = [b for b, a in self.acc if not a and sources & b]
        if not bits:
            return 0.3
        alt_bits = sources if alt is True else int(alt)
        return max(self.acc[b, bool(alt_bits & b)] / self.tries[b, bool(alt_bits & b)] for b in bits)

    def update(self, tree: Tree, path: list[int]) -> None:
        reached, accepted = {0} | set(path), set(path)
        alts = alternatives(tree)
        for i in range(1, len(tree)):
            if tree.parents[i] in reached:
                for b, alt in self.acc:
                    if tree.sources[i] & b and alt == bool(alts[i] & b):
                        self.tries[b, alt] += 1
                        self.acc[b, alt] += i in accepted

    def as_dict(self) -> dict:
        return {f"{b}{'/alt' if alt else ''}": round(self.acc[b, alt] / self.tries[b, alt], 3) for b, alt in self.acc}


def alternatives(tree: Tree) -> list[int]:
    """Per node, the source bits for which it is not the first child of its parent: an earlier sibling has the bit."""
    seen: dict[int, int] = {}  # parent -> bits of its children so far
    out = [0] * len(tree)
    for i in range(1, len(tree)):
        p = tree.parents[i]
        out[i] = seen.get(p, 0) & tree.sources[i]
        seen[p] = seen.get(p, 0) | tree.sources[i]
    return out


def node_probs(tree: Tree, acceptance: Acceptance) -> list[float]:
    probs = [1.0] * len(tree)
    alts = alternatives(tree)
    for i in range(1, len(tree)):
        probs[i] = probs[tree.parents[i]] * acceptance.rate(tree.sources[i], alts[i])
    return probs


def subtree(tree: Tree, keep: list[int]) -> Tree:
    """The tree restricted to `keep` (ancestor-closed node indices), re-indexed in topological order."""
    keep = sorted(keep)
    new = {old: i for i, old in enumerate(keep)}
    return Tree(tokens=[tree.tokens[i] for i in keep],
                parents=[-1 if tree.parents[i] < 0 else new[tree.parents[i]] for i in keep],
                depths=[tree.depths[i] for i in keep], sources=[tree.sources[i] for i in keep])


def best_chain(tree: Tree, acceptance: Acceptance, max_len: int, min_p: float = 0.0) -> list[int]:
    """For engines that verify one chain a step (vLLM): the root-to-node path with the most expected accepted tokens
    (the sum of its nodes' probabilities, `node_probs`), at most `max_len` draft nodes, cut before the first node
    whose probability of being reached is below `min_p` (a long chain of a source that keeps failing costs verify
    time and buys nothing). Returns the path's node indices, root excluded."""
    probs = node_probs(tree, acceptance)
    gain = [0.0] * len(tree)
    best, best_gain = 0, 0.0
    for i in range(1, len(tree)):
        if tree.depths[i] > max_len or probs[i] < min_p:
            gain[i] = float("-inf")
            continue
        gain[i] = gain[tree.parents[i]] + probs[i]
        if gain[i] > best_gain:
            best, best_gain = i, gain[i]
    path = []
    while best > 0:
        path.append(best)
        best = tree.parents[best]
    return path[::-1]


class TreeBudget:
    """Chooses each round's tree from the cost curve and the acceptance statistics (see the module docstring)."""

    def __init__(self, curve: CostCurve, max_nodes: int = 32, acceptance: Acceptance | None = None,
                 draft_s: float | None = None):
        self.curve, self.max_nodes = curve, max_nodes
        self.acceptance = acceptance or Acceptance()
        self.draft_s = draft_s  # a fixed drafting time per round instead of the measured one (deterministic replays)
        self.overhead_s = 0.0 if draft_s is None else draft_s  # running mean of a round's drafting time
        self.rounds = 0
        self.skip = False      # the last drafted round did not pay for its own drafting: skip drafting for a while

    def start_request(self) -> None:
        """A new request starts undecided: its round counter and skip flag are its own (an earlier request's
        text-only answer must not leave the next one undrafted); the learned acceptance rates and drafting time
        carry over."""
        self.rounds, self.skip = 0, False

    def should_draft(self) -> bool:
        """Whether to propose at all this round. After a round whose best tree did not beat a plain decode step once
        its drafting time is counted, rounds go without drafting (a plain step, no drafting cost) except every
        EXPLORE_EVERY-th, which drafts again and learns; so decoding is never slower than `ar` by more than that."""
        return not (self.skip and (self.rounds + 1) % EXPLORE_EVERY != 0)

    def choose(self, tree: Tree) -> tuple[Tree, float]:
        """(the tree to verify, its expected committed tokens)."""
        self.rounds += 1
        if len(tree) <= 1:
            self.skip = True  # nothing was proposed: drafting cost time and bought nothing
            return tree, 1.0
        probs = node_probs(tree, self.acceptance)
        order = sorted(range(1, len(tree)), key=lambda i: (-probs[i], i))[: self.max_nodes - 1]
        best_k, best_rate, expected, gains = 1, 1.0 / (self.curve.cost(1) + self.overhead_s), 1.0, 1.0
        for k, i in enumerate(order, start=2):
            gains += probs[i]
            rate = gains / (self.curve.cost(k) + self.overhead_s)
            if rate > best_rate:
                best_k, best_rate, expected = k, rate, gains
        # nothing worth verifying, or not worth its drafting time: plain steps until the next exploration round
        self.skip = best_k == 1 or best_rate * self.curve.cost(1) < 1.0
        if best_k == 1 and self.rounds % EXPLORE_EVERY == 0:
            best_k, expected = 2, 1.0 + probs[order[0]]
        return subtree(tree, [0] + order[: best_k - 1]), expected

    def update(self, tree: Tree, path: list[int], draft_s: float) -> None:
        self.acceptance.update(tree, path)
        if self.draft_s is not None:
            return
        self.overhead_s = 0.9 * self.overhead_s + 0.1 * draft_s if self.rounds > 1 else draft_s


__all__ = ["CostCurve", "Acceptance", "TreeBudget", "SIZES", "subtree", "node_probs", "alternatives", "best_chain"]

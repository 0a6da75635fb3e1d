"""A target that replays recorded outputs: measure drafters' acceptance without a model (and test the loop).

`ReplayTarget(tokenizer, outputs)` behaves like `Target` for `generate`: its greedy "prediction" after any token
tree node is the next token of the recorded output for that request when the node's path agrees with the
recording (and end of turn once the recording is used up). Accepted lengths, forwards and hint tokens then equal
what a real target that writes exactly that text would give, which makes it the tool for studying drafters on
recorded target outputs (e.g. a benchmark's `ar` outputs) in milliseconds. It has no KV cache; with a cost curve
(`curve=`, see budget.py) the loop's tree budget chooses tree sizes as it would on that hardware, and `simulated_s`
adds up what the verified forwards would have cost there (the way to replay, say, an AVX2 machine's curve).
"""

from __future__ import annotations

from pipeline.requests import render_prompt

from .target import decode, encode
from .verify import Tree


class ReplayTarget:
    tree = True

    def __init__(self, tokenizer, outputs: dict[str, list[int] | str], name: str = "replay", curve=None):
        self.tokenizer, self.name, self.curve = tokenizer, name, curve
        self.budgets: dict[str, object] = {}
        self.simulated_s = 0.0
        eos = tokenizer.eos_token_id
        self.stop_ids = {eos}
        self.outputs = {rid: (encode(tokenizer, o) + [eos]) if isinstance(o, str) else list(o)
                        for rid, o in outputs.items()}
        self.histories: dict[str, object] = {}
        self.script: list[int] = []
        self.done = 0

    def prompt_ids(self, request: dict) -> list[int]:
        self.script = self.outputs[request["id"]]
        return encode(self.tokenizer, render_prompt(self.tokenizer, request))

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def set_threads(self, n: int) -> None:
        pass

    def prefill(self, ids: list[int], key: str | None = None, reuse: bool = False, prefix_cache: bool = True,
                chunk: int | None = None, between=None, salt: str | None = None, inside=None) -> float:
        self.done = 0
        self.last_prefill = {"seconds": 0.0, "cpu_s": 0.0, "reused": False, "spent": 0.0}
        return 0.0

    def _next(self, at: int) -> int:
        return self.script[at] if at < len(self.script) else next(iter(self.stop_ids))

    def verify(self, tree: Tree) -> list[int]:
        if self.curve is not None:
            self.simulated_s += self.curve.cost(len(tree))
        out, agrees = [], []
        for i, (tok, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
            ok = i == 0 or (agrees[parent] and tok == self._next(self.done + depth - 1))
            agrees.append(ok)
            out.append(self._next(self.done + depth) if ok else self._next(0))
        return out

    def keep(self, tree_len: int, nodes: list[int]) -> None:
        self.done += len(nodes) + 1

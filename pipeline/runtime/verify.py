"""Pure rules of speculative verification: draft candidates -> token tree, tree -> mask/positions, acceptance.

A round verifies a *token tree* in one target forward. Node 0 is the root: the last committed token, whose KV
entry is not in the cache yet. Every other node is a draft token whose parent is the node before it in some
candidate; candidates that share a prefix share nodes (a trie), so a tree of k nodes costs one forward of k tokens.

Acceptance (greedy, lossless): start at the root; the target's argmax at a node is the token it would write next;
if a child of that node carries exactly that token, the target "agrees" and we move to the child, else we stop.
The accepted tokens are the path's draft tokens plus the target's own next token at the last node (the bonus).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    """A token tree in topological order. tokens[0] is the root (last committed token); parents[0] = -1."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[int] = field(default_factory=list)  # bitmask of the drafters whose candidates contain each node

    def __len__(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[dict[int, int]]:
        """children[node] = {token: child node}."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]][self.tokens[i]] = i
        return kids


def build_tree(root: int, candidates: list[tuple[list[int], int]], max_nodes: int, max_depth: int) -> Tree:
    """Merge (draft tokens, source bit) candidates, best first, into a trie of at most `max_nodes` nodes.

    Earlier candidates have priority: a candidate that no longer fits is cut where the budget ends.
    """
    tree = Tree(tokens=[root], parents=[-1], depths=[0], sources=[0])
    kids: list[dict[int, int]] = [{}]
    for tokens, source in candidates:
        node = 0
        for tok in tokens[:max_depth]:
            nxt = kids[node].get(tok)
            if nxt is None:
                if len(tree.tokens) >= max_nodes:
                    break
                nxt = len(tree.tokens)
                tree.tokens.append(tok)
                tree.parents.append(node)
                tree.depths.append(tree.depths[node] + 1)
                tree.sources.append(0)
                kids.append({})
                kids[node][tok] = nxt
            tree.sources[nxt] |= source
            node = nxt
    return tree


def best_chain(root: int, candidates: list[tuple[list[int], int]], max_nodes: int, max_depth: int) -> Tree:
    """Fallback for targets that cannot take a custom mask: only the best (first non-empty) candidate, as a chain."""
    for tokens, source in candidates:
        if tokens:
            return build_tree(root, [(tokens, source)], max_nodes, max_depth)
    return build_tree(root, [], max_nodes, max_depth)


def tree_mask(parents: list[int], past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive 4-D mask [1, 1, T, past + T]: each node sees the whole cache, itself and its ancestors."""
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        allowed[i, i] = True
        if p >= 0:
            allowed[i] |= allowed[p]
    mask = torch.zeros(n, past + n, dtype=dtype)
    mask[:, past:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def tree_positions(depths: list[int], past: int, device=None) -> torch.Tensor:
    """position_ids [1, T] = past length + depth in the tree."""
    return (torch.tensor(depths, dtype=torch.long) + past).to(device)[None]


def accept(tree: Tree, argmax: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance on a tree: (accepted node indices, root excluded, in path order; the bonus token)."""
    kids = tree.children()
    node, path = 0, []
    while True:
        nxt = kids[node].get(argmax[node])
        if nxt is None:
            return path, argmax[node]
        path.append(nxt)
        node = nxt


def accept_chain(draft: list[int], argmax: list[int]) -> list[int]:
    """The chain rule spelled out: longest draft prefix equal to the target's argmax, plus its next token.

    argmax[i] is the target's prediction after the root and draft[:i]; returns the committed tokens.
    """
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return list(draft[:n]) + [argmax[n]]


def truncate_at_stop(tokens: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """Cut committed tokens at the first stop token (kept) or when `room` new tokens are used; (tokens, stopped)."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stop_ids:
            return tokens[:i + 1], True
    return tokens[:room], len(tokens) >= room

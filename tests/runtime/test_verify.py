"""The pure verification rules: token trees, masks, positions, greedy acceptance, stops."""

import torch

from pipeline.runtime.verify import accept, accept_chain, best_chain, build_tree, tree_mask, tree_positions, \
    truncate_at_stop


def test_build_tree_merges_shared_prefixes_and_respects_budget():
    tree = build_tree(9, [([1, 2, 3], 1), ([1, 2, 4], 2), ([5], 4)], max_nodes=10, max_depth=8)
    assert tree.tokens == [9, 1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.depths == [0, 1, 2, 3, 3, 1]
    assert tree.sources == [0, 3, 3, 1, 2, 4]
    small = build_tree(9, [([1, 2, 3], 1), ([7, 8], 2)], max_nodes=3, max_depth=8)
    assert small.tokens == [9, 1, 2]  # the best candidate is cut where the budget ends; the next gets nothing
    assert build_tree(9, [([1, 2, 3, 4], 1)], 10, max_depth=2).tokens == [9, 1, 2]
    assert best_chain(9, [([], 1), ([7, 8], 2), ([1], 4)], 10, 8).tokens == [9, 7, 8]


def test_tree_mask_lets_a_node_see_the_cache_itself_and_its_ancestors_only():
    parents = [-1, 0, 1, 0]
    mask = tree_mask(parents, past=2, dtype=torch.float64)
    assert mask.shape == (1, 1, 4, 6)
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen == [[1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 0, 0, 1]]
    assert tree_positions([0, 1, 2, 1], past=2).tolist() == [[2, 3, 4, 3]]


def test_accept_walks_the_branch_the_target_agrees_with():
    tree = build_tree(9, [([1, 2, 3], 1), ([1, 5, 6], 2)], 10, 8)  # nodes: 9 1 2 3 5 6
    # target: after 9 -> 1, after 1 -> 5, after 5 -> 6, after 6 -> 42
    argmax = [1, 5, 0, 0, 6, 42]
    path, bonus = accept(tree, argmax)
    assert [tree.tokens[i] for i in path] == [1, 5, 6] and bonus == 42
    assert accept(tree, [7, 0, 0, 0, 0, 0]) == ([], 7)
    assert accept_chain([1, 2, 3], [1, 2, 8, 0]) == [1, 2, 8]
    assert accept_chain([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]


def test_truncate_at_stop_keeps_eos_and_respects_room():
    assert truncate_at_stop([1, 2, 0, 3], {0}, room=10) == ([1, 2, 0], True)
    assert truncate_at_stop([1, 2, 3], {0}, room=2) == ([1, 2], True)
    assert truncate_at_stop([1, 2, 3], {0}, room=5) == ([1, 2, 3], False)

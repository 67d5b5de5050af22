"""The prefix tree itself: paths reconstruct every input, unmerged trees hold exactly the trie's
distinct tokens, the merge rule keeps a branch point iff (k - 1)·L exceeds the threshold
(bottom-up), and levels are consistent."""

from __future__ import annotations

import random

import pytest

from asyncrl.trainer.prefix_tree import PrefixTree, prefix_tree, prompt_tree

THRESHOLD = 256


def random_inputs(seed: int, n: int = 40) -> list[list[int]]:
    """Inputs that share prefixes of every kind: common heads, exact duplicates, prefixes of others."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 9) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    out: list[list[int]] = []
    for _ in range(n):
        kind = rng.random()
        if out and kind < 0.15:
            out.append(list(rng.choice(out)))  # a duplicate
        elif out and kind < 0.3:
            other = rng.choice(out)
            out.append(other[: rng.randrange(1, len(other) + 1)])  # a prefix of another input
        else:
            head = rng.choice(heads)[: rng.randrange(0, 30)]
            out.append(head + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 12))])
    return out


def trie_nodes(inputs: list[list[int]]) -> int:
    """Distinct non-empty prefixes: the nodes of the uncompressed trie."""
    return len({tuple(x[:k]) for x in inputs for k in range(1, len(x) + 1)})


def check_structure(tree: PrefixTree, inputs: list[list[int]]) -> None:
    for i, x in enumerate(inputs):
        assert tree.sample_input(i) == x
        assert 0 < tree.ends[i] <= len(tree.paths[i][-1])
    for level, rows in enumerate(tree.levels):
        for row, seg in enumerate(rows):
            assert (seg.level, seg.row) == (level, row)
            assert len(seg) > 0
            if level:
                assert seg.parent.level == level - 1
                assert seg.start == seg.parent.start + len(seg.parent)
            else:
                assert seg.start == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [-1, 0, 20, THRESHOLD, 10**9])
def test_every_path_reconstructs_its_input(seed: int, threshold: int) -> None:
    """Whatever is merged, each sample's path reads back its input exactly; levels are consistent."""
    inputs = random_inputs(seed)
    check_structure(prefix_tree(inputs, threshold), inputs)
    prompt_lengths = [random.Random(seed + i).randrange(1, len(x) + 1) for i, x in enumerate(inputs)]
    check_structure(prompt_tree(inputs, prompt_lengths, threshold), inputs)


@pytest.mark.parametrize("seed", range(6))
def test_unmerged_tree_forwards_each_trie_node_once(seed: int) -> None:
    """Threshold 0 merges nothing a radix tree holds: its tokens are the trie's distinct nodes."""
    inputs = random_inputs(seed)
    tree = prefix_tree(inputs, 0)
    assert tree.distinct_tokens == trie_nodes(inputs)
    assert tree.distinct_tokens < sum(len(x) for x in inputs)
    assert tree.tokens >= tree.distinct_tokens  # the rows of a level are padded to one width
    # Nothing merged: every segment but a leaf has at least two children.
    assert all(len(seg.children) != 1 for rows in tree.levels for seg in rows)


def test_tokens_forwarded_equal_trie_nodes_without_padding() -> None:
    """A prompt of 50 and 8 completions of 9 fed-back tokens: 50 + 8·9 tokens, two passes, no padding."""
    prompt = list(range(50))
    inputs = [prompt + [100 + k] * 9 for k in range(8)]
    tree = prefix_tree(inputs, 0)
    assert tree.tokens == tree.distinct_tokens == trie_nodes(inputs) == 50 + 8 * 9
    assert tree.passes == 2
    assert [len(rows) for rows in tree.levels] == [1, 8]


@pytest.mark.parametrize(("prompt_len", "kept"), [(36, False), (37, True)])
def test_merge_rule_keeps_a_branch_point_iff_it_saves_more_than_the_threshold(
    prompt_len: int, kept: bool
) -> None:
    """8 children of a P-token segment save 7·P tokens: kept iff 7·P > 256, i.e. P ≥ 37."""
    prompt = list(range(prompt_len))
    inputs = [prompt + [100 + k, 200 + k] for k in range(8)]
    for tree in (prefix_tree(inputs, THRESHOLD), prompt_tree(inputs, [prompt_len] * 8, THRESHOLD)):
        check_structure(tree, inputs)
        if kept:
            assert tree.passes == 2 and tree.distinct_tokens == prompt_len + 8 * 2
        else:  # merged: each child starts with its own copy of the prompt
            assert tree.passes == 1 and tree.distinct_tokens == 8 * (prompt_len + 2)


def test_merge_rule_runs_bottom_up() -> None:
    """System prompt S (30) → 2 questions (5 each) → 8 completions each.

    Each question saves 7·5 = 35 ≤ 256 and is merged into its completions, so S has 16
    children and saves 15·30 = 450 > 256: kept. Judged top-down (2 children: 30 ≤ 256) S
    would have been merged too.
    """
    system = list(range(30))
    inputs = [system + [50 + q] * 5 + [100 + 8 * q + k] * 3 for q in range(2) for k in range(8)]
    tree = prefix_tree(inputs, THRESHOLD)
    check_structure(tree, inputs)
    assert [len(rows) for rows in tree.levels] == [1, 16]
    assert tree.levels[0][0].tokens == system
    assert {len(seg) for seg in tree.levels[1]} == {5 + 3}
    assert tree.tokens == 30 + 16 * 8
    # Without merges: three passes, S, the questions, the completions.
    assert [len(rows) for rows in prefix_tree(inputs, 0).levels] == [1, 2, 16]


def test_a_single_child_is_always_merged() -> None:
    """A segment with one child saves nothing; in the prompt tree it is merged unless the threshold is negative."""
    inputs = [[1, 2, 3, 4, 5, 6], [1, 2, 3]]  # the second ends at the first's prompt
    assert prompt_tree(inputs, [3, 3], 0).passes == 1
    kept = prompt_tree(inputs, [3, 3], -1)
    assert [[seg.tokens for seg in rows] for rows in kept.levels] == [[[1, 2, 3]], [[4, 5, 6]]]
    check_structure(kept, inputs)


def test_inputs_ending_inside_a_segment_do_not_split_it() -> None:
    """An input that is a prefix of another ends inside its segment: no branch point, one pass."""
    inputs = [[1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3, 4, 5]]
    tree = prefix_tree(inputs, -1)
    assert [[seg.tokens for seg in rows] for rows in tree.levels] == [[[1, 2, 3, 4, 5]]]
    assert tree.ends == [5, 3, 5]


def test_prompt_tree_branches_only_at_prompt_ends() -> None:
    """Prompts sharing a head stay apart, and identical completions are rows of their own."""
    inputs = [[1, 2, 3, 7, 8], [1, 2, 3, 7, 8], [1, 2, 9, 7]]
    tree = prompt_tree(inputs, [3, 3, 3], -1)
    assert [[seg.tokens for seg in rows] for rows in tree.levels] == [
        [[1, 2, 3], [1, 2, 9]],
        [[7, 8], [7, 8], [7]],
    ]
    check_structure(tree, inputs)
    shared = prefix_tree(inputs, -1)
    assert [[seg.tokens for seg in rows] for rows in shared.levels] == [[[1, 2]], [[3, 7, 8], [9, 7]]]

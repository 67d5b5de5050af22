"""A prefix tree over the model inputs of a micro-batch, compressed into token segments.

A sample's model input is its prompt followed by the completion tokens that are fed back
in (all but the last trained one, see :func:`~asyncrl.trainer.batching.trained_span`).
Inputs that begin alike — the completions of one prompt, groups behind one system prompt,
a multi-turn history that a later turn extends, completions whose first tokens agree —
share a path from the root. The trie over the inputs is compressed into a radix tree whose
nodes are :class:`Segment` s, runs of tokens with one path to the root; each segment is
forwarded once for every sample that runs through it.

**Where to branch.** A segment of L tokens with k children saves (k - 1)·L tokens by being
forwarded once instead of once per child, and costs one more forward pass (its children run
after it, against its KV cache). A pass has a fixed cost, counted as ``threshold`` tokens
(the trainer uses ``MICRO_BATCH_OVERHEAD_TOKENS``), so a segment is kept as a branch point
only if (k - 1)·L > threshold; otherwise it is merged into its children, each of which then
starts with a copy of its tokens. Merging runs bottom-up, so a segment's k counts the
children it has after the merges below it (a merged child's children become its own). The
rule charges every kept branch point a pass even where another segment at the same depth
already pays for it: it errs towards fewer passes.

**Levels.** A segment's level is its depth among segments: the children of the root are
level 0. The forward pass runs level by level (see :mod:`asyncrl.trainer.packing`); a
level's cost is its row count times its longest segment, because the rows are padded to one
width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Segment:
    """A run of tokens of the tree; ``start`` is the number of tokens on its ancestors."""

    tokens: list[int]
    parent: Segment | None
    start: int
    children: list[Segment] = field(default_factory=list)
    # (sample index, how many of this segment's tokens end that sample's input)
    ends: list[tuple[int, int]] = field(default_factory=list)
    level: int = -1
    row: int = -1

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixTree:
    """The segments of each level and, per sample, its path of segments from the root.

    Invariants: a segment's parent is on the level above it; a sample's input is the
    concatenation of the tokens on its path, of which the last segment contributes the first
    ``ends[i]`` tokens (a sample may end inside a segment that other samples continue).
    """

    levels: list[list[Segment]]
    paths: list[tuple[Segment, ...]]
    ends: list[int]

    @property
    def tokens(self) -> int:
        """Token positions the forward runs over: every level's rows times its width."""
        return sum(len(rows) * max(len(s) for s in rows) for rows in self.levels)

    @property
    def distinct_tokens(self) -> int:
        """Tokens held by the segments (padding excluded)."""
        return sum(len(s) for rows in self.levels for s in rows)

    @property
    def passes(self) -> int:
        return len(self.levels)

    def sample_input(self, i: int) -> list[int]:
        """Sample ``i``'s input, read back from its path."""
        *head, last = self.paths[i]
        return [t for s in head for t in s.tokens] + last.tokens[: self.ends[i]]


def prefix_tree(inputs: Sequence[Sequence[int]], threshold: int) -> PrefixTree:
    """The radix tree of ``inputs``, with branch points that do not pay merged (see module doc)."""
    root = Segment([], None, 0)
    heads: dict[Segment, dict[int, Segment]] = {root: {}}  # a segment's children by first token
    for i, key in enumerate(inputs):
        key = list(key)
        node, pos = root, 0
        while True:
            child = heads[node].get(key[pos])
            if child is None:
                leaf = Segment(key[pos:], node, pos, ends=[(i, len(key) - pos)])
                node.children.append(leaf)
                heads[node][key[pos]] = leaf
                heads[leaf] = {}
                break
            m = _common_prefix(child.tokens, key, pos)
            if pos + m == len(key):  # the input ends inside (or at the end of) this segment
                child.ends.append((i, m))
                break
            if m < len(child):
                _split(child, m, heads)
            node, pos = child, pos + m
    return _finish(root, len(inputs), threshold)


def prompt_tree(inputs: Sequence[Sequence[int]], prompt_lengths: Sequence[int], threshold: int) -> PrefixTree:
    """The tree that branches only at prompt ends: each distinct prompt, then each sample's rest.

    This is the shared-prompt layout: identical prompts are one segment, every sample's
    completion input is a segment of its own. Prompts that do not pay are merged as above.
    """
    root = Segment([], None, 0)
    prompts: dict[tuple[int, ...], Segment] = {}
    for i, (key, p) in enumerate(zip(inputs, prompt_lengths, strict=True)):
        prompt = tuple(key[:p])
        seg = prompts.get(prompt)
        if seg is None:
            seg = prompts[prompt] = Segment(list(prompt), root, 0)
            root.children.append(seg)
        if len(key) == p:
            seg.ends.append((i, p))
        else:
            seg.children.append(Segment(list(key[p:]), seg, p, ends=[(i, len(key) - p)]))
    return _finish(root, len(inputs), threshold)


def _common_prefix(tokens: list[int], key: list[int], pos: int) -> int:
    n = min(len(tokens), len(key) - pos)
    if tokens[:n] == key[pos : pos + n]:  # the common case, compared at C speed
        return n
    for k in range(n):
        if tokens[k] != key[pos + k]:
            return k
    return n


def _split(seg: Segment, m: int, heads: dict[Segment, dict[int, Segment]]) -> None:
    """Cut ``seg`` after ``m`` tokens; the rest becomes its only child and keeps its children."""
    tail = Segment(seg.tokens[m:], seg, seg.start + m, children=seg.children)
    tail.ends = [(i, n - m) for i, n in seg.ends if n > m]
    for c in tail.children:
        c.parent = tail
    heads[tail] = heads[seg]
    heads[seg] = {tail.tokens[0]: tail}
    seg.tokens, seg.children = seg.tokens[:m], [tail]
    seg.ends = [(i, n) for i, n in seg.ends if n <= m]


def _merge_unprofitable(root: Segment, threshold: int) -> None:
    """Bottom-up: merge each segment whose sharing saves at most ``threshold`` tokens into its children."""
    order, stack = [], [root]
    while stack:
        seg = stack.pop()
        order.append(seg)
        stack.extend(seg.children)
    replacement: dict[Segment, list[Segment]] = {}
    for seg in reversed(order):  # every segment after all of its descendants
        seg.children = [c for child in seg.children for c in replacement[child]]
        for c in seg.children:
            c.parent = seg
        k, length = len(seg.children), len(seg)
        if seg is root or k == 0 or (k - 1) * length > threshold:
            replacement[seg] = [seg]
            continue
        for c in seg.children:
            c.tokens = seg.tokens + c.tokens
            c.start = seg.start
            c.ends = [(i, n + length) for i, n in c.ends]
        # Inputs that end inside this segment end inside the first child's copy of it.
        seg.children[0].ends = seg.ends + seg.children[0].ends
        replacement[seg] = seg.children


def _finish(root: Segment, n_samples: int, threshold: int) -> PrefixTree:
    _merge_unprofitable(root, threshold)
    levels: list[list[Segment]] = []
    frontier = root.children
    while frontier:
        for row, seg in enumerate(frontier):
            seg.level, seg.row = len(levels), row
        levels.append(frontier)
        frontier = [c for seg in frontier for c in seg.children]
    last: list[Segment | None] = [None] * n_samples
    ends = [0] * n_samples
    for rows in levels:
        for seg in rows:
            for i, n in seg.ends:
                last[i], ends[i] = seg, n
    paths = []
    for seg in last:
        path = []
        while seg is not None and seg.parent is not None:
            path.append(seg)
            seg = seg.parent
        paths.append(tuple(reversed(path)))
    return PrefixTree(levels, paths, ends)

"""Suffix decoding's draft source: suffix tries over this request's tokens and recent requests.

SuffixDecoding (Snowflake's Arctic Inference, vLLM's `method: "suffix"`) keeps two indexes:
one over the running request's own prompt and output (prompt lookup, but counted), and one
shared by all requests over earlier requests' answers, so a question asked before gets the
earlier answer as its draft. Each index is a trie of the windows `seq[i : i + max_tree_depth]`
starting at every position, each node counting the windows that pass through it. A draft
matches the context's last tokens in a trie and follows the most frequent child while the
running product of `child.count / node.count` stays at or above `min_token_prob`.

The structure, chosen by measurement (bench/bench_suffix_index.py): a plain trie of depth 24
costs one Python object per (position, depth), ~55 ms and ~36k objects to index a 1500-token
prompt. Here a path that only one window takes is not spelled out: it is a leaf, the tuple
`(seq, start)` naming the window, read from the sequence itself. Explicit nodes exist only
where two or more windows share a path, so unrepeated text costs one leaf per position and
indexing walks only as deep as the text repeats itself (a few ms for 1500 tokens).
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# A leaf: the window seq[start : start + depth] (or to the end of seq), alone on its path.
_Leaf = tuple[list[int], int]


class _Node:
    """A trie node that at least two windows pass through (one, transiently, in eviction).

    `count` is the number of windows through it (those ending here included); `best` caches
    the token of its most frequent child (ties to the lower token id), None while unknown;
    `ends` holds the windows that end exactly here (only kept where eviction needs to name
    them).
    """

    __slots__ = ("count", "children", "best", "ends")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: int | None = None
        self.ends: list[_Leaf] | None = None


def _count(child: "_Node | _Leaf") -> int:
    return child.count if type(child) is _Node else 1


def _counted(node: _Node, t: int, count: int) -> None:
    """Keep `node.best` after its child `t` gained a window (now `count`)."""
    best = node.best
    if best is None:
        if len(node.children) == 1:
            node.best = t
    elif best != t:
        best_count = _count(node.children[best])
        if count > best_count or (count == best_count and t < best):
            node.best = t


def _best(node: _Node) -> int | None:
    """The token of `node`'s most frequent child (ties to the lower id), cached."""
    if node.best is None and node.children:
        children = node.children
        node.best = min(children, key=lambda t: (-_count(children[t]), t))
    return node.best


class _SuffixTree:
    """The windows of depth `depth` starting at each indexed position, counted per trie path."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0)
        self._orders: dict[tuple[int, float], list[tuple[int, int]]] = {}

    def _ended(self, node: _Node, window: _Leaf) -> None:
        """`window` now ends at explicit `node` (its whole path is shared)."""
        raise NotImplementedError

    def _insert(self, seq: list[int], start: int, node: _Node, d: int) -> _Node | None:
        """Count window `(seq, start)` below `node`, where its first `d` tokens are counted
        already. Returns the explicit node it ends at, or None when it ends in its own leaf."""
        length = min(self.depth, len(seq) - start)
        while d < length:
            t = seq[start + d]
            children = node.children
            child = children.get(t)
            if child is None:
                children[t] = (seq, start)
                _counted(node, t, 1)
                return None
            d += 1
            if type(child) is tuple:
                # Another window's leaf: the shared token becomes an explicit node.
                other_seq, other_start = child
                child = children[t] = _Node(1)
                if min(self.depth, len(other_seq) - other_start) > d:
                    nxt = other_seq[other_start + d]
                    child.children[nxt] = (other_seq, other_start)
                    child.best = nxt
                else:
                    self._ended(child, (other_seq, other_start))
            child.count += 1
            _counted(node, t, child.count)
            node = child
        self._ended(node, (seq, start))
        return node

    def speculate(
        self, matches: list["_Node | _Leaf"], k: int, factor: float, min_prob: float
    ) -> tuple[float, list[int]]:
        """(score, draft): Arctic's path mode, the best draft over every match length.

        `matches[m - 1]` is where the context's last m tokens lead (`_Match`), for m = 1 up to
        the longest match. A match of length m drafts up to min(k, int(m * factor)) tokens;
        its score is the sum of the drafted tokens' running probabilities; the highest score
        wins, ties to the longer match. Arctic drafts from every m; here the lengths go in
        order of the most their draft could score (`_by_bound`, then the first step's
        probability times the length), and stop once none can win: the same draft, fewer
        walks.
        """
        best_score, best_m, best_draft = 0.0, 0, []
        longest = len(matches)
        for m, bound in self._by_bound(k, factor):
            if bound < best_score:
                break
            if m > longest or (bound == best_score and m < best_m):
                continue
            found = matches[m - 1]
            budget = min(k, int(m * factor + 1e-6))
            if type(found) is tuple:
                # Inside one window's leaf: its continuation is certain (probability 1).
                seq, start = found
                draft = seq[start + m : min(start + self.depth, len(seq), start + m + budget)]
                score = float(len(draft))
            else:
                best = _best(found)
                if best is None:
                    continue
                # Running probabilities never grow: the first one bounds them all (with a
                # margin for rounding, so the winner is exactly Arctic's).
                first = _count(found.children[best]) / found.count
                if first * bound < best_score - 1e-9:
                    continue
                score, draft = self._follow(found, m, budget, min_prob)
            if draft and (score > best_score or (score == best_score and m > best_m)):
                best_score, best_m, best_draft = score, m, draft
        return best_score, best_draft

    def _by_bound(self, k: int, factor: float) -> list[tuple[int, int]]:
        """(m, the most a match of length m can score) for every m, highest bound first, then
        longest: a draft has at most min(k, int(m * factor)) tokens, and at most depth - m
        (windows are depth long), each scoring at most 1. Cached per (k, factor)."""
        key = (k, factor)
        order = self._orders.get(key)
        if order is None:
            bounds = [
                (m, min(k, int(m * factor + 1e-6), self.depth - m)) for m in range(1, self.depth)
            ]
            order = self._orders[key] = sorted(bounds, key=lambda mb: (-mb[1], -mb[0]))
        return order

    def _follow(self, node: _Node, d: int, budget: int, min_prob: float) -> tuple[float, list[int]]:
        """Draft from explicit `node` at depth `d` along the most frequent children."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < budget:
            best = _best(node)
            if best is None:
                break
            child = node.children[best]
            prob *= _count(child) / node.count
            if prob < min_prob:
                break
            if type(child) is tuple:
                seq, start = child
                end = min(start + self.depth, len(seq), start + d + budget - len(draft))
                for token in seq[start + d : end]:
                    draft.append(token)
                    score += prob  # summed, not multiplied: equal scores stay equal
                break
            draft.append(best)
            score += prob
            node = child
            d += 1
        return score, draft

    def num_nodes(self) -> int:
        """Explicit nodes plus leaves (a walk of the whole trie: for tests and benchmarks)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                total += 1
                if type(child) is _Node:
                    stack.append(child)
        return total


class _RequestTree(_SuffixTree):
    """One running request's tokens, indexed as they arrive.

    The windows starting in the last `depth - 1` positions are still growing. One that ends in
    its own leaf grows for free (the leaf reads the live sequence); one that ends at an
    explicit node is in `tails` and takes one trie step per new token.
    """

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.seq: list[int] = []
        self.tails: dict[int, _Node] = {}

    def _ended(self, node: _Node, window: _Leaf) -> None:
        start = window[1]
        if len(self.seq) - start < self.depth:
            self.tails[start] = node

    def extend(self, tokens: Sequence[int]) -> None:
        seq, depth, tails = self.seq, self.depth, self.tails
        for t in tokens:
            seq.append(t)
            n = len(seq)
            for start, node in list(tails.items()):
                child = node.children.get(t)
                if type(child) is _Node:  # the shared path goes on: `_insert`'s common case
                    child.count += 1
                    if node.best != t:
                        _counted(node, t, child.count)
                    if n - start < depth:
                        tails[start] = child
                    else:
                        del tails[start]
                    continue
                end = self._insert(seq, start, node, n - start - 1)
                if end is None or n - start >= depth:
                    del tails[start]
            self._insert(seq, n - 1, self.root, 0)

    def matches(self) -> list[_Node]:
        """Where the last m tokens lead for m = 1, 2, ... (see `speculate`), for free: the
        window that starts m tokens from the end is exactly those tokens, and it ends at an
        explicit node iff they also occur elsewhere (a leaf would be its own end, no
        continuation). Contiguous: if m tokens occur elsewhere, so do their last m - 1."""
        n, tails = len(self.seq), self.tails
        found = []
        for m in range(1, min(n, self.depth)):
            node = tails.get(n - m)
            if node is None:
                break
            found.append(node)
        return found


class _GlobalTree(_SuffixTree):
    """Finished requests' sequences; each can be removed again exactly (eviction).

    A running request follows where its last tokens lead here (`follow`) one token at a time,
    rather than walking from the root for every match length each step; `version` counts the
    changes that make such positions stale.
    """

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.version = 0

    def _ended(self, node: _Node, window: _Leaf) -> None:
        if node.ends is None:
            node.ends = []
        node.ends.append(window)

    def add(self, seq: list[int]) -> None:
        self.version += 1
        for start in range(len(seq)):
            self._insert(seq, start, self.root, 0)

    def remove(self, seq: list[int]) -> None:
        self.version += 1
        for start in range(len(seq)):
            self._remove(seq, start)

    def follow(self, matches: list["_Node | _Leaf"], t: int) -> list["_Node | _Leaf"]:
        """The matches (see `speculate`) after token `t` is appended to the context: the
        match of m + 1 tokens is the match of m tokens followed by `t`. Match lengths stay
        below `depth` (a full-depth match has nothing after it)."""
        child = self.root.children.get(t)
        if child is None:
            return []
        out = [child]
        for m, found in enumerate(matches[: self.depth - 2], 1):
            if type(found) is _Node:
                found = found.children.get(t)
                if found is None:
                    break
            else:  # inside a leaf: its next token must be t
                seq, start = found
                if min(self.depth, len(seq) - start) <= m or seq[start + m] != t:
                    break
            out.append(found)
        return out

    def _remove(self, seq: list[int], start: int) -> None:
        """Uncount window `(seq, start)`, leaving the trie as if it had never been added:
        nodes no window passes any more go, nodes one window passes become its leaf."""
        length = min(self.depth, len(seq) - start)
        path: list[tuple[_Node, int]] = []
        node = self.root
        for d in range(length):
            t = seq[start + d]
            child = node.children[t]
            if node.best == t:
                node.best = None
            if type(child) is tuple:
                assert child[0] is seq and child[1] == start, "a leaf holds one window"
                del node.children[t]
                break
            child.count -= 1
            path.append((node, t))
            node = child
        else:
            ends = node.ends
            assert ends is not None
            del ends[next(i for i, w in enumerate(ends) if w[0] is seq and w[1] == start)]
        # Deepest first, so a node left with one window finds that window's leaf below it.
        for parent, t in reversed(path):
            child = parent.children[t]
            assert type(child) is _Node
            if child.count == 0:
                del parent.children[t]
            elif child.count == 1:
                # The one window left ends here, or goes on in its leaf (collapsed already).
                last = child.ends[0] if child.ends else next(iter(child.children.values()))
                parent.children[t] = last
            else:
                break


@dataclass(slots=True)
class _Request:
    tree: _RequestTree  # its own tokens
    first_len: int  # its token count at its first `propose` call
    version: int = -1  # the shared trie's version that `matches` are for
    matches: list["_Node | _Leaf"] = field(default_factory=list)  # in the shared trie


class SuffixProposer:
    """Drafts by SuffixDecoding (arXiv 2411.04975; vLLM's `method: "suffix"`), in pure Python.

    Each running request has its own trie over its prompt and output (searchable while it
    runs); a shared trie holds finished requests' answers with the `max_tree_depth` tokens
    before them: the tokens from `max_tree_depth` before the last one of the first `propose`
    call (which the runner makes after the first sampled token), i.e. the prompt's last
    `max_tree_depth - 1` tokens and the whole output. A match can reach back no further than
    that into the prompt, so a later request whose prompt ends as an earlier one's did gets the
    earlier answer as its draft from its first step, while whole prompts (long, and mostly a
    shared system prompt) are not stored once per request.
    Answers enter the shared trie when their request finishes, not while it runs: two users
    asking the same question at the same moment do not help each other.

    `propose` matches the last `max_tree_depth` tokens in both tries, as Arctic's path mode
    (see `_SuffixTree.speculate`), and returns the draft with the higher score (the request's
    own on a tie). Per call it indexes only the tokens not seen before for that request.

    Parameters (vLLM's `suffix_decoding_*` keys, same defaults):
      max_tree_depth: the longest window indexed per position; bounds the match length plus
        the draft length, and memory per indexed token. 24.
      max_cached_requests: finished requests kept in the shared trie; the oldest is evicted
        (exactly: the trie is then as if it had never held it) beyond this. 0 disables the
        shared trie (each request's own trie is still used). 10000.
      max_spec_factor: a match of m tokens drafts at most int(max_spec_factor * m) tokens (and
        at most the caller's k): longer evidence, longer drafts. 1.0.
      min_token_prob: a drafted token's estimated probability (the product of
        child.count / parent.count along the draft) must be at least this. 0.1.

    Memory: a leaf per indexed position plus an explicit node per distinct repeated window
    prefix; the shared trie holds at most `max_cached_requests` sequences.
    """

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth={max_tree_depth} must be >= 1")
        if max_cached_requests < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests={max_cached_requests} must be >= 0"
            )
        if not max_spec_factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor={max_spec_factor} must be > 0")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix_decoding_min_token_prob={min_token_prob} must be in [0, 1]")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _Request] = {}
        self._global = _GlobalTree(max_tree_depth)
        self._cached: deque[list[int]] = deque()  # the shared trie's sequences, oldest first

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        req = self._requests.get(req_id)
        if req is None or len(token_ids) < len(req.tree.seq):
            # New, or its tokens were replaced by fewer (not a continuation): start over.
            req = self._requests[req_id] = _Request(
                _RequestTree(self.max_tree_depth), len(token_ids)
            )
        tree = req.tree
        # int(): the runner passes numpy arrays, whose scalars hash and compare slower.
        new = [int(t) for t in token_ids[len(tree.seq) :]]
        tree.extend(new)
        if self.max_cached_requests:
            shared = self._global
            if req.version != shared.version or len(new) >= self.max_tree_depth:
                req.version, req.matches, new = (
                    shared.version,
                    [],
                    tree.seq[1 - self.max_tree_depth :],
                )
            for t in new:
                req.matches = shared.follow(req.matches, t)
        if k <= 0:
            return []
        score, draft = tree.speculate(tree.matches(), k, self.max_spec_factor, self.min_token_prob)
        if self.max_cached_requests:
            # A match must leave a token of the context before it (as Arctic's).
            matches = req.matches[: len(tree.seq) - 1]
            shared_score, shared_draft = self._global.speculate(
                matches, k, self.max_spec_factor, self.min_token_prob
            )
            if shared_score > score:
                draft = shared_draft
        return draft

    def finish(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        if req is None or not self.max_cached_requests:
            return
        seq = req.tree.seq[max(0, req.first_len - self.max_tree_depth) :]
        self._global.add(seq)
        self._cached.append(seq)
        if len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())

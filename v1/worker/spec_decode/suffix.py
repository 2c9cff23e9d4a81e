"""Suffix decoding's draft source: suffix trees over this request's tokens and recent requests.

Two indexes (vLLM's `method: "suffix"`): the running request's own prompt and output, and one
shared over earlier requests' answers. Each indexes the windows `seq[i : i + max_tree_depth]`,
each node counting the windows through it; a draft follows the most frequent child while the
product of `child.count / node.count` stays >= `min_token_prob`. The trie is compressed: a
one-count chain is one `_Node` over `seq[lo:hi]`, a one-window path a leaf `(seq, start)`, so a
token costs O(1) per growing window (docs/benchmarks.md, "Suffix index").
"""

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from v1.config.speculative import DEFAULT_SUFFIX_MAX_CACHED_TOKENS

# A leaf: the window seq[start : start + depth] (or to the end of seq), alone on its path.
_Leaf = tuple[list[int], int]

# The most of a request's tokens its own tree indexes per `propose` call: a long prompt is
# indexed over several steps (the tree drafts once it has caught up), so that the step that
# first proposes for many requests (n > 1 over a long prompt) does not index them all at once.
MAX_INDEX_TOKENS = 256


class _Node:
    """A compressed chain of trie nodes: tokens `seq[lo:hi]` from `parent`'s end to its own.

    Every trie node of the chain has `count` windows through it (those ending at its end
    included: no window ends inside it). Except the root, a node has two or more children or
    a window ending at it; otherwise it is merged into its child. `seq` is the sequence of a
    window through it, so `seq[lo - d : lo]` spells the path above it (d = its depth).
    `best` caches the key of its most frequent child (ties to the lower token), None while
    unknown; `ends` lists the windows ending at it (kept in the shared tree only, for
    eviction).
    """

    __slots__ = ("count", "children", "best", "ends", "seq", "lo", "hi", "parent")

    def __init__(self, count: int, seq: list[int], lo: int, hi: int, parent: "_Node | None"):
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: int | None = None
        self.ends: list[_Leaf] | None = None
        self.seq = seq
        self.lo = lo
        self.hi = hi
        self.parent = parent


# Where some tokens lead in a tree: (node, how many of its tokens they reach into, >= 1), or
# the leaf (a window) they lie in.
_Position = tuple[_Node, int] | _Leaf


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
    """The key of `node`'s most frequent child (ties to the lower token), cached."""
    if node.best is None and node.children:
        children = node.children
        node.best = min(children, key=lambda t: (-_count(children[t]), t))
    return node.best


class _SuffixTree:
    """The windows of `depth` tokens starting at each position of the sequences it indexes."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0, [], 0, 0, None)
        self._orders: dict[tuple[int, float], list[tuple[int, int]]] = {}

    def _complete(self, node: _Node, window: _Leaf) -> None:
        """`window`, full grown, ends at `node`."""

    def _extend(self, seq: list[int], tails: dict[int, _Node], tokens: Sequence[int]) -> None:
        """Append `tokens` to `seq`, indexing the windows they add to.

        The windows starting in the last `depth - 1` positions still grow. One that ends in
        its own leaf grows for free (the leaf reads `seq`); one that ends at a node is in
        `tails` (start -> that node) and takes one `_grow` step per token.
        """
        depth = self.depth
        for t in tokens:
            seq.append(t)
            n = len(seq)
            for start, node in list(tails.items()):
                end = self._grow(seq, start, node, t, tails)
                if end is None:
                    del tails[start]
                elif n - start < depth:
                    tails[start] = end
                else:
                    del tails[start]
                    self._complete(end, (seq, start))
            end = self._grow(seq, n - 1, self.root, t, tails)
            if end is not None:
                if depth > 1:
                    tails[n - 1] = end
                else:
                    self._complete(end, (seq, n - 1))

    def _grow(
        self, seq: list[int], start: int, node: _Node, t: int, tails: dict[int, _Node]
    ) -> _Node | None:
        """Window `(seq, start)`, which ended at `node`'s end, now goes on with `t` (the last
        token of `seq`). Returns the node it ends at, or None when it ends in its own leaf."""
        children = node.children
        child = children.get(t)
        if child is None:
            children[t] = (seq, start)
            _counted(node, t, 1)
            return None
        d = len(seq) - 1 - start  # the depth of node's end
        if len(children) == 1 and node.count == _count(child) + 1 and node.parent is not None:
            # Only this window ended at `node` and all else goes on with t: `node` takes t
            # over from its child (its `seq` goes on with t too: it is a window through it).
            # The common case in repeated text, where every growing window takes this path.
            node.hi += 1
            del children[t]
            if type(child) is tuple:
                self._hang(node, child, d + 1, seq, tails)
            elif child.hi - child.lo == 1:
                node.children, node.best, node.ends = child.children, child.best, child.ends
                for below in node.children.values():
                    if type(below) is _Node:
                        below.parent = node
            else:
                child.lo += 1
                nxt = child.seq[child.lo]
                children[nxt] = child
                node.best = nxt
            return node
        if type(child) is tuple:
            # Another window's leaf: its first token becomes a node the two share.
            other, other_start = child
            end = _Node(2, other, other_start + d, other_start + d + 1, node)
            children[t] = end
            self._hang(end, child, d + 1, seq, tails)
        elif child.hi - child.lo == 1:
            end = child
            end.count += 1
        else:
            # Split off the chain's first token: the window ends there.
            end = _Node(child.count + 1, child.seq, child.lo, child.lo + 1, node)
            child.lo += 1
            child.parent = end
            nxt = child.seq[child.lo]
            end.children[nxt] = child
            end.best = nxt
            children[t] = end
        _counted(node, t, end.count)
        return end

    def _hang(
        self, node: _Node, leaf: _Leaf, d: int, seq: list[int], tails: dict[int, _Node]
    ) -> None:
        """Put `leaf`, whose window's first `d` tokens now lead to childless `node`'s end,
        below `node`, or record that it ends there."""
        other, other_start = leaf
        if min(self.depth, len(other) - other_start) > d:
            nxt = other[other_start + d]
            node.children[nxt] = leaf
            node.best = nxt
        else:
            node.best = None
            if other is seq and len(seq) - other_start < self.depth:
                tails[other_start] = node
            else:
                self._complete(node, leaf)

    def speculate(
        self, matches: list[_Position], k: int, factor: float, min_prob: float
    ) -> tuple[float, list[int]]:
        """(score, draft): Arctic's path mode, the best draft over every match length.

        `matches[m - 1]` is where the context's last m tokens lead, for m = 1 up to the
        longest match. A match of length m drafts up to min(k, int(m * factor)) tokens; its
        score is the sum of the drafted tokens' running probabilities; the highest score wins
        (compared to 9 decimals, so that rounding does not pick among equals), ties to the
        longer match. Arctic drafts from every m; here the lengths go in order of the most
        their draft could score (`_by_bound`, then the first step's probability times that),
        and stop once none can win: the same draft, fewer walks.
        """
        best_score, best_m, best_draft = 0.0, 0, []  # the score to 9 decimals
        longest = len(matches)
        for m, bound in self._by_bound(k, factor):
            if bound < best_score:
                break
            if m > longest or (bound == best_score and m < best_m):
                continue
            budget = min(k, int(m * factor + 1e-6))
            where, offset = matches[m - 1]
            if type(where) is not _Node:
                # Inside one window's leaf: its continuation is certain (probability 1).
                draft = where[
                    offset + m : min(offset + self.depth, len(where), offset + m + budget)
                ]
                score = float(len(draft))
            else:
                if offset == where.hi - where.lo:
                    first = _best(where)
                    if first is None:
                        continue
                    # Running probabilities never grow: the first bounds them all (+ a margin
                    # for the rounding of their sum).
                    bound_here = _count(where.children[first]) / where.count * bound + 1e-12
                    if bound_here < best_score - 5e-10 or (
                        m < best_m and bound_here < best_score + 5e-10
                    ):
                        continue
                score, draft = self._follow(where, offset, m, budget, min_prob)
                score = round(score, 9)
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

    def _follow(
        self, node: _Node, offset: int, d: int, budget: int, min_prob: float
    ) -> tuple[float, list[int]]:
        """Draft from `offset` tokens into `node` (at depth `d`) along the most frequent
        children."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while True:
            # The rest of the chain: one count, so the probability does not change.
            take = min(node.hi - node.lo - offset, budget - len(draft))
            if take > 0:
                lo = node.lo + offset
                for token in node.seq[lo : lo + take]:
                    draft.append(token)
                    score += prob  # summed, not multiplied: equal scores stay equal
                d += take
            if len(draft) >= budget:
                break
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
                    score += prob
                break
            node, offset = child, 0
        return score, draft

    def num_nodes(self) -> int:
        """Nodes plus leaves (a walk of the whole tree: for tests and benchmarks)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                total += 1
                if type(child) is _Node:
                    stack.append(child)
        return total


class _RequestTree(_SuffixTree):
    """One running request's tokens (`seq`), indexed as they arrive."""

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.seq: list[int] = []
        self.tails: dict[int, _Node] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        self._extend(self.seq, self.tails, tokens)

    def matches(self) -> list[_Position]:
        """Where the last m tokens lead for m = 1, 2, ... (see `speculate`), for free: the
        window that starts m tokens from the end is exactly those tokens, and it ends at a
        node iff they also occur elsewhere (a leaf would be its own end, no continuation).
        Contiguous: if m tokens occur elsewhere, so do their last m - 1."""
        n, tails = len(self.seq), self.tails
        found: list[_Position] = []
        for m in range(1, min(n, self.depth)):
            node = tails.get(n - m)
            if node is None:
                break
            found.append((node, node.hi - node.lo))
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

    def _complete(self, node: _Node, window: _Leaf) -> None:
        if node.ends is None:
            node.ends = []
        node.ends.append(window)

    def add(self, tokens: Sequence[int]) -> list[int]:
        """Index `tokens`; returns the list that names them here (for `remove`)."""
        self.version += 1
        seq: list[int] = []
        tails: dict[int, _Node] = {}
        self._extend(seq, tails, tokens)
        for start, node in tails.items():
            self._complete(node, (seq, start))
        return seq

    def remove(self, seq: list[int]) -> None:
        """Forget `seq` (from `add`): the tree is then as if it had never held it."""
        self.version += 1
        for start in range(len(seq)):
            self._remove(seq, start)
        for start in range(len(seq)):
            self._repoint(seq, start)

    def _remove(self, seq: list[int], start: int) -> None:
        length = min(self.depth, len(seq) - start)
        path: list[_Node] = []
        node, d = self.root, 0
        while d < length:
            t = seq[start + d]
            child = node.children[t]
            if node.best == t:
                node.best = None
            if type(child) is tuple:
                assert child[0] is seq and child[1] == start, "a leaf holds one window"
                del node.children[t]
                break
            child.count -= 1
            path.append(child)
            d += child.hi - child.lo
            node = child
        else:
            ends = node.ends
            assert ends is not None
            del ends[next(i for i, w in enumerate(ends) if w[0] is seq and w[1] == start)]
        # Deepest first: a node with one window left finds that window's leaf below it.
        for node in reversed(path):
            parent = node.parent
            assert parent is not None
            key = node.seq[node.lo]
            if node.count == 0:
                del parent.children[key]
                continue  # the parent lost a child: it may have to go too
            if node.count == 1:
                # The one window left ends here or goes on in its leaf: it is a leaf here.
                parent.children[key] = (
                    node.ends[0] if node.ends else next(iter(node.children.values()))
                )
            elif len(node.children) == 1 and not node.ends:
                child = next(iter(node.children.values()))
                assert type(child) is _Node
                child.lo -= node.hi - node.lo
                child.parent = parent
                parent.children[key] = child
            break

    def _repoint(self, seq: list[int], start: int) -> None:
        """Nodes on window `(seq, start)`'s path, which `remove` left, that spell their
        tokens from `seq` now spell them from a window still here (so `seq` can go)."""
        length = min(self.depth, len(seq) - start)
        node, d = self.root, 0
        while d < length:
            child = node.children.get(seq[start + d])
            if type(child) is not _Node:
                return
            size = child.hi - child.lo
            if child.seq is seq:
                witness = child
                while witness.ends is None or not witness.ends:
                    below = next(iter(witness.children.values()))
                    if type(below) is tuple:
                        break
                    witness = below
                else:
                    below = witness.ends[0]
                other, other_start = below
                child.seq, child.lo, child.hi = other, other_start + d, other_start + d + size
            if child.seq[child.lo : child.hi] != seq[start + d : start + d + size]:
                return
            node, d = child, d + size

    def follow(self, matches: list[_Position], t: int) -> list[_Position]:
        """The matches (see `speculate`) after token `t` is appended to the context: the
        match of m + 1 tokens is the match of m tokens followed by `t`. Match lengths stay
        below `depth` (a full-depth match has nothing after it)."""
        out: list[_Position] = []
        child = self.root.children.get(t)
        if child is None:
            return out
        out.append(child if type(child) is tuple else (child, 1))
        for m, (where, offset) in enumerate(matches[: max(0, self.depth - 2)], 1):
            if type(where) is _Node:
                if offset < where.hi - where.lo:
                    if where.seq[where.lo + offset] != t:
                        break
                    out.append((where, offset + 1))
                    continue
                child = where.children.get(t)
                if child is None:
                    break
                out.append(child if type(child) is tuple else (child, 1))
            else:  # inside a leaf: its next token must be t
                if min(self.depth, len(where) - offset) <= m or where[offset + m] != t:
                    break
                out.append((where, offset))
        return out


@dataclass(slots=True)
class _Request:
    tree: _RequestTree  # its own tokens, indexed up to where it has caught up
    tokens: list[int]  # every token it has proposed after (prompt and output)
    first_len: int  # its token count at its first `propose` call
    scope: Hashable  # whose answers it may draft from (`start`)
    shared: "_GlobalTree | None" = None  # the shared tree that `matches` are in
    version: int = -1  # that tree's version that `matches` are for
    matches: list[_Position] = field(default_factory=list)


class SuffixProposer:
    """Drafts by SuffixDecoding (arXiv 2411.04975; vLLM's `method: "suffix"`), in pure Python.

    Each running request has its own tree over its prompt and output (searchable while it
    runs); a shared tree holds finished requests' answers with the `max_tree_depth` tokens
    before them: the tokens from `max_tree_depth` before the last one of the first `propose`
    call (which the runner makes after the first sampled token), i.e. the prompt's last
    `max_tree_depth - 1` tokens and the whole output. A match can reach back no further than
    that into the prompt, so a later request whose prompt ends as an earlier one's did gets the
    earlier answer as its draft from its first step, while whole prompts (long, and mostly a
    shared system prompt) are not stored once per request.
    Answers enter the shared tree when their request finishes, not while it runs: two users
    asking the same question at the same moment do not help each other.

    The shared tree is one per scope (`start`: the runner's is the request's cache_salt and
    LoRA adapter, as the prefix cache keys blocks): a request drafts only from answers of its
    own scope, so how fast its stream goes tells nothing of other tenants' answers. The bounds
    below hold for all scopes together.

    `propose` matches the last `max_tree_depth` tokens in both trees, as Arctic's path mode
    (see `_SuffixTree.speculate`), and returns the draft with the higher score (the request's
    own on a tie). Per call it indexes only the tokens not seen before for that request, and
    at most `max_index_tokens` of them in its own tree (which drafts once it has caught up).

    Parameters (vLLM's `suffix_decoding_*` keys, same defaults):
      max_tree_depth: the longest window indexed per position; bounds the match length plus
        the draft length. 24.
      max_cached_requests: finished requests kept in the shared tree; the oldest is evicted
        (exactly: the tree is then as if it had never held it) beyond this. 0 disables the
        shared tree (each request's own tree is still used). 10000.
      max_cached_tokens (v1's own, `suffix_decoding_max_cached_tokens`; vLLM bounds requests
        only): the most tokens the shared tree indexes; the oldest requests are evicted
        beyond it, and an answer longer than it on its own is not cached. 1,000,000 tokens,
        which caps the shared tree at ~190 MB of natural text (see Memory): 10000 short
        answers fit, 10000 long ones (10000 x 2000 tokens would be ~3.7 GB) do not. 0
        disables the shared tree.
      max_spec_factor: a match of m tokens drafts at most int(max_spec_factor * m) tokens (and
        at most the caller's k): longer evidence, longer drafts. 1.0.
      min_token_prob: a drafted token's estimated probability (the product of
        child.count / parent.count along the draft) must be at least this. 0.1.
      max_index_tokens (v1's own, not a config key): the most tokens a request's own tree
        indexes per call, so a step's indexing is bounded by its requests times this.
        `MAX_INDEX_TOKENS`.

    Memory: about one leaf and at most one node per indexed token, ~187 bytes per token
    of the shared tree; it holds at most `max_cached_requests` sequences of
    `max_cached_tokens` tokens in all. Its costs per call: docs/benchmarks.md (suffix index).
    """

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_tokens: int = DEFAULT_SUFFIX_MAX_CACHED_TOKENS,
        max_index_tokens: int = MAX_INDEX_TOKENS,
    ) -> None:
        if max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth={max_tree_depth} must be >= 1")
        if max_cached_requests < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests={max_cached_requests} must be >= 0"
            )
        if max_cached_tokens < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_tokens={max_cached_tokens} must be >= 0"
            )
        if not max_spec_factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor={max_spec_factor} must be > 0")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix_decoding_min_token_prob={min_token_prob} must be in [0, 1]")
        if max_index_tokens < 1:
            raise ValueError(f"max_index_tokens={max_index_tokens} must be >= 1")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self._shared = max_cached_requests > 0 and max_cached_tokens > 0  # a shared tree
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_index_tokens = max_index_tokens
        self._requests: dict[str, _Request] = {}
        self._scopes: dict[str, Hashable] = {}  # req_id -> its scope, from `start`
        self._trees: dict[Hashable, _GlobalTree] = {}  # scope -> its shared tree, if any
        # The shared trees' sequences with their scopes, oldest first.
        self._cached: deque[tuple[Hashable, list[int]]] = deque()
        self.num_cached_tokens = 0  # their total length

    def start(self, req_id: str, scope: Hashable) -> None:
        self._scopes[req_id] = scope

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        req = self._requests.get(req_id)
        if req is None or len(token_ids) < len(req.tokens):
            # New, or its tokens were replaced by fewer (not a continuation): start over.
            req = self._requests[req_id] = _Request(
                _RequestTree(self.max_tree_depth), [], len(token_ids),
                self._scopes.get(req_id),
            )
        tokens = req.tokens
        num_new = len(token_ids) - len(tokens)
        # int(): the runner passes a numpy view, whose scalars hash and compare slower; only
        # the tokens new since the last call are read (and kept: the view is the runner's).
        tokens.extend(map(int, token_ids[len(tokens) :]))
        tree = req.tree
        done = len(tree.seq)
        tree.extend(tokens[done : done + self.max_index_tokens])
        shared = self._trees.get(req.scope) if self._shared else None
        if shared is None:
            req.shared, req.matches = None, []
        else:
            if req.shared is not shared or req.version != shared.version or (
                num_new >= self.max_tree_depth
            ):
                req.shared, req.version, req.matches = shared, shared.version, []
                num_new = min(len(tokens), self.max_tree_depth - 1)
            for t in tokens[len(tokens) - num_new :]:
                req.matches = shared.follow(req.matches, t)
        if k <= 0:
            return []
        score, draft = 0.0, []
        if len(tree.seq) == len(tokens):  # caught up: its matches are the context's
            score, draft = tree.speculate(
                tree.matches(), k, self.max_spec_factor, self.min_token_prob
            )
        if shared is not None:
            # A match must leave a token of the context before it (as Arctic's).
            matches = req.matches[: len(tokens) - 1]
            shared_score, shared_draft = shared.speculate(
                matches, k, self.max_spec_factor, self.min_token_prob
            )
            if shared_score > score:
                draft = shared_draft
        return draft

    def drop(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def finish(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        self._scopes.pop(req_id, None)
        if req is None or not self._shared:
            return
        tokens = req.tokens[max(0, req.first_len - self.max_tree_depth) :]
        if len(tokens) > self.max_cached_tokens:
            return  # it would evict everything, itself included
        tree = self._trees.get(req.scope)
        if tree is None:
            tree = self._trees[req.scope] = _GlobalTree(self.max_tree_depth)
        self._cached.append((req.scope, tree.add(tokens)))
        self.num_cached_tokens += len(tokens)
        while (
            len(self._cached) > self.max_cached_requests
            or self.num_cached_tokens > self.max_cached_tokens
        ):
            scope, oldest = self._cached.popleft()
            self.num_cached_tokens -= len(oldest)
            tree = self._trees[scope]
            tree.remove(oldest)
            if not tree.root.children:  # a scope's last answer went: no empty trees kept
                del self._trees[scope]

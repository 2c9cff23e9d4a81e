"""SuffixProposer: drafts from the request's own tokens and from earlier requests' answers,
Arctic's path-mode semantics (checked against a plain trie), exact eviction, bounded memory."""

import random

import numpy as np
import pytest

from v1.worker.spec_decode import suffix
from v1.worker.spec_decode.suffix import SuffixProposer, _GlobalTree, _Node

PROMPT = list(range(1000, 1040))  # a system prompt and a question, all distinct tokens
ANSWER = list(range(2000, 2030))


def run_request(
    p: SuffixProposer, req_id: str, prompt: list[int], answer: list[int], k: int = 8
) -> list[list[int]]:
    """Decode `answer` one token per step as the runner does (propose after each sampled
    token), then finish; returns the draft of each step."""
    drafts = [p.propose(req_id, prompt + answer[: i + 1], k) for i in range(len(answer))]
    p.finish(req_id)
    return drafts


def shared_tree(p: SuffixProposer, scope=None) -> _GlobalTree:
    """The shared tree of `scope` (an empty one when it has none)."""
    return p._trees.get(scope) or _GlobalTree(p.max_tree_depth)


def cached(p: SuffixProposer) -> list[list[int]]:
    """The shared trees' sequences, oldest first."""
    return [seq for _, seq in p._cached]


def test_repeats_an_earlier_requests_answer() -> None:
    p = SuffixProposer()
    run_request(p, "a", PROMPT, ANSWER)
    # A second user asks the same: right after its first token, the rest of the earlier answer.
    assert p.propose("b", PROMPT + ANSWER[:1], 8) == ANSWER[1:9]
    assert p.propose("b", PROMPT + ANSWER[:12], 8) == ANSWER[12:20]
    # Another system prompt, same question (the prompt's last tokens): the same answer.
    other = list(range(3000, 3030)) + PROMPT[-12:]
    assert p.propose("c", other + ANSWER[:1], 4) == ANSWER[1:5]


def test_own_prompt_lookup_while_running() -> None:
    passage = list(range(4000, 4020))
    prompt = [1, 2, 3] + passage + [5, 6, 7]
    p = SuffixProposer(max_cached_requests=0)  # the request's own tokens only
    # The output starts quoting the passage: its continuation is the draft (as long as the
    # match, max_spec_factor=1).
    assert p.propose("a", prompt + passage[:5], 8) == passage[5:10]
    # Its own output is searchable too: a loop it started repeats.
    loop = [7000, 7001, 7002, 7003, 7004, 7005]
    assert p.propose("a", prompt + passage[:5] + loop + loop[:4], 4) == loop[4:] + loop[:2]


def test_a_numpy_view_of_a_reused_buffer_is_read_as_a_list() -> None:
    # As the runner calls it: views of its token buffer, which it reuses once the request
    # leaves. Drafts are as from lists; what the index keeps is Python ints, not the view.
    buf = np.array(PROMPT + ANSWER, dtype=np.int32)
    p = SuffixProposer()
    views = [p.propose("a", buf[: len(PROMPT) + i + 1], 8) for i in range(len(ANSWER))]
    assert all(type(t) is int for t in p._requests["a"].tokens)
    p.finish("a")
    buf[:] = 0  # the runner's row, reused
    assert views == run_request(SuffixProposer(), "a", PROMPT, ANSWER)
    assert p.propose("b", PROMPT + ANSWER[:1], 8) == ANSWER[1:9]


def test_min_token_prob_cuts_the_draft() -> None:
    # "9 8" was followed by "1 2 3" twice and "4 5 6" twice (after other tokens each time):
    # each continuation has p = 2/5 (the context's own "9 8", not continued yet, counts too);
    # the tie goes to the lower token id.
    context = [60, 9, 8, 1, 2, 3, 61, 9, 8, 4, 5, 6, 62, 9, 8, 1, 2, 3, 63, 9, 8, 4, 5, 6, 64, 9, 8]
    for min_prob, draft in ((0.4, [1, 2, 3]), (0.41, [])):
        p = SuffixProposer(max_spec_factor=2.0, min_token_prob=min_prob)
        assert p.propose("a", context, 3) == draft


def test_max_spec_factor_caps_the_draft_by_the_match_length() -> None:
    # The context's last 2 tokens match once before; nothing longer does.
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2]
    assert SuffixProposer(max_spec_factor=1.0).propose("a", context, 8) == [3, 4]
    assert SuffixProposer(max_spec_factor=0.5).propose("a", context, 8) == [3]
    assert SuffixProposer(max_spec_factor=3.0).propose("a", context, 8) == [3, 4, 5, 6, 7, 8]


def test_k_is_respected() -> None:
    # A deep tree, so that the depth left after the match does not cap the draft by itself.
    p = SuffixProposer(max_tree_depth=64)
    run_request(p, "a", PROMPT, ANSWER)
    for k in range(0, 12):
        assert p.propose(f"b{k}", PROMPT + ANSWER[:5], k) == ANSWER[5 : 5 + k]  # shared tree
        own = PROMPT + ANSWER + PROMPT[:30]
        assert p.propose(f"c{k}", own, k) == (PROMPT + ANSWER)[30 : 30 + k]  # both trees


def test_empty_and_tiny_contexts() -> None:
    p = SuffixProposer()
    run_request(p, "a", [5], [5, 5, 5])
    assert p.propose("b", [], 4) == []
    assert p.propose("c", [5], 4) == []  # a match must leave a token before it
    p.finish("b")
    p.finish("never-seen")


def test_a_preempted_request_is_dropped_not_published() -> None:
    """drop (preemption): its state goes and nothing enters the shared tree; it comes back
    with the same tokens and is published once, when it finishes."""
    p = SuffixProposer()
    p.propose("a", PROMPT + ANSWER[:10], 8)
    p.drop("a")
    assert p._requests == {} and not p._cached
    run_request(p, "a", PROMPT, ANSWER)
    assert len(p._cached) == 1
    assert p.propose("b", PROMPT + ANSWER[:5], 4) == ANSWER[5:9]


def test_finish_drops_the_requests_state() -> None:
    p = SuffixProposer(max_cached_requests=0)
    looped = [1, 2, 3, 4, 1, 2]
    assert p.propose("a", looped, 2) == [3, 4]
    p.finish("a")
    assert p._requests == {}
    # The same req_id again, with other tokens: nothing of the old request is left.
    assert p.propose("a", [1, 2], 2) == []


def dump(node: _Node, depth: int, d: int = 0) -> dict:
    """The tree as plain data, by content: two trees are the same index iff equal."""
    out = {}
    for t, child in node.children.items():
        if type(child) is tuple:
            seq, start = child
            out[t] = ("leaf", tuple(seq[start + d : min(start + depth, len(seq))]))
        else:
            chain = tuple(child.seq[child.lo : child.hi])
            below = dump(child, depth, d + len(chain))
            out[t] = (chain, child.count, len(child.ends or ()), below)
    return out


def check_tree(root: _Node, depth: int, exact_ends: bool) -> None:
    """The tree's invariants: every node spells its path from its own `seq`, counts add up
    (exactly where windows ending at a node are listed), and no node could merge."""
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        below = 0
        for t, child in node.children.items():
            if type(child) is tuple:
                seq, start = child
                assert tuple(seq[start : start + len(path) + 1]) == path + (t,)
                assert min(depth, len(seq) - start) > len(path)
                below += 1
                continue
            chain = tuple(child.seq[child.lo : child.hi])
            assert chain and chain[0] == t and child.parent is node and child.count >= 2
            assert tuple(child.seq[child.lo - len(path) : child.lo]) == path
            assert len(path) + len(chain) <= depth
            below += child.count
            stack.append((child, path + chain))
        if node is root:
            continue
        ends = node.count - below
        assert ends >= 0
        if exact_ends:
            assert ends == len(node.ends or ())
        assert len(node.children) >= 2 or ends > 0, "a node that should be merged"


def referenced(root: _Node) -> set[int]:
    """The ids of the sequences the tree's nodes and leaves read their tokens from."""
    ids, stack = set(), [root]
    while stack:
        for child in stack.pop().children.values():
            if type(child) is tuple:
                ids.add(id(child[0]))
            else:
                ids.add(id(child.seq))
                stack.append(child)
    return ids


def random_answers(rng: random.Random, n: int, vocab: int, length: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, length))] for _ in range(n)]


@pytest.mark.parametrize("keep, max_tokens", [(5, None), (1000, 90)], ids=["requests", "tokens"])
def test_eviction_is_exact(keep: int, max_tokens: int | None) -> None:
    """After evicting the oldest requests (beyond `keep` requests, or `max_tokens` tokens in
    the shared tree), the shared trie is the one built without them (node for node, counts
    and leaves), and drafts are the same."""
    rng = random.Random(0)
    depth = 6
    caps = {} if max_tokens is None else {"max_cached_tokens": max_tokens}
    p = SuffixProposer(max_tree_depth=depth, max_cached_requests=keep, **caps)
    prompt = [7, 7, 1]
    # A small vocabulary: answers share many windows, so eviction must split counts right.
    answers = random_answers(rng, 40, 4, 30) + [[1, 2, 3]] * 3  # identical ones too
    added: list[list[int]] = []  # what each request put in the shared tree
    for i, answer in enumerate(answers):
        run_request(p, f"r{i}", prompt, answer)
        added.append(prompt[-(depth - 1) :] + answer)
        # The newest sequences that fit both caps, no more and no fewer.
        kept, total = [], 0
        for seq in reversed(added[-keep:]):
            if max_tokens is not None and total + len(seq) > max_tokens:
                break
            kept.insert(0, seq)
            total += len(seq)
        assert cached(p) == kept
        rebuilt = SuffixProposer(max_tree_depth=depth, max_cached_requests=keep, **caps)
        tree = rebuilt._trees[None] = _GlobalTree(depth)
        rebuilt._cached.extend((None, tree.add(seq)) for seq in cached(p))
        assert dump(shared_tree(p).root, depth) == dump(tree.root, depth)
        check_tree(shared_tree(p).root, depth, exact_ends=True)
        assert referenced(shared_tree(p).root) <= {id(seq) for seq in cached(p)}  # evicted: gone
        for j in range(5):
            ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            assert p.propose(f"q{i}.{j}", ctx, 5) == rebuilt.propose(f"q{i}.{j}", ctx, 5)
    if max_tokens is None:
        assert len(p._cached) == keep
    else:
        assert 3 < len(p._cached) < keep and p.num_cached_tokens <= max_tokens


def test_an_answer_longer_than_the_token_cap_is_not_cached() -> None:
    p = SuffixProposer(max_tree_depth=4, max_cached_tokens=40)
    run_request(p, "a", PROMPT, ANSWER[:20])
    kept = cached(p)
    run_request(p, "b", PROMPT, list(range(5000, 5040)))  # 3 + 40 tokens: more than the cap
    assert cached(p) == kept and p.num_cached_tokens == 23


def test_memory_stays_bounded() -> None:
    rng = random.Random(1)
    depth, keep = 8, 20
    p = SuffixProposer(max_tree_depth=depth, max_cached_requests=keep)
    sizes = []
    for i in range(300):
        answer = [rng.randrange(50) for _ in range(40)]
        run_request(p, f"r{i}", PROMPT, answer, k=4)
        sizes.append(shared_tree(p).num_nodes())
    assert p._requests == {}
    # Each cached sequence is at most `depth` prompt tokens + 40 answer tokens, each position
    # one leaf plus at most one new explicit node per insertion (a split).
    assert max(sizes) <= keep * (depth + 40) * 2
    assert sizes[-1] <= max(sizes[:50]) * 1.2  # no drift once the cache is full


class PlainTrie:
    """The reference: an uncompressed trie of every window, Arctic's path mode over it."""

    def __init__(self, depth: int, seqs: list[list[int]]) -> None:
        self.depth = depth
        self.root: list = [0, {}]
        for seq in seqs:
            for i in range(len(seq)):
                node = self.root
                for t in seq[i : i + depth]:
                    node = node[1].setdefault(t, [0, {}])
                    node[0] += 1

    def speculate(self, pattern: list[int], k: int, factor: float, min_prob: float):
        best_score, best = 0.0, []
        for m in range(1, len(pattern)):
            node = self.root
            for t in pattern[len(pattern) - m :]:
                node = node[1].get(t)
                if node is None:
                    return best_score, best
            budget, draft, prob, score = min(k, int(m * factor + 1e-6)), [], 1.0, 0.0
            while len(draft) < budget and node[1]:
                t, child = min(node[1].items(), key=lambda item: (-item[1][0], item[0]))
                prob *= child[0] / node[0]
                if prob < min_prob:
                    break
                draft.append(t)
                score += prob
                node = child
            # Scores compared to 9 decimals (as SuffixProposer), ties to the longer match.
            if draft and round(score, 9) >= best_score:
                best_score, best = round(score, 9), draft
        return best_score, best


@pytest.mark.parametrize("seed", range(6))
def test_drafts_match_a_plain_trie(seed: int) -> None:
    """Every step's draft, own and shared tries, equals the uncompressed reference's, with
    requests running side by side, finishing and being evicted."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 8])
    factor = rng.choice([0.5, 1.0, 2.0])
    min_prob = rng.choice([0.0, 0.1, 0.4])
    keep = 4
    p = SuffixProposer(depth, keep, factor, min_prob)
    cached: list[list[int]] = []
    running: dict[str, tuple[list[int], int, int]] = {}  # req_id -> (tokens, first, n)
    for r in range(40):
        vocab = rng.choice([2, 3, 6])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        first = rng.randrange(1, len(tokens) + 1)
        running[f"r{r}"] = (tokens, first, first)
        while len(running) >= 3 or (running and r == 39):
            req_id = rng.choice(sorted(running))
            tokens, first, n = running[req_id]
            if n > len(tokens):
                p.finish(req_id)
                del running[req_id]
                cached = (cached + [tokens[max(0, first - depth) :]])[-keep:]
                continue
            k = rng.randrange(0, 7)
            ctx = tokens[:n]
            pattern = ctx[-depth:]
            own = PlainTrie(depth, [ctx]).speculate(pattern, k, factor, min_prob)
            shared = PlainTrie(depth, cached).speculate(pattern, k, factor, min_prob)
            expected = shared[1] if shared[0] > own[0] else own[1]
            assert p.propose(req_id, ctx, k) == expected, (req_id, n)
            check_tree(p._requests[req_id].tree.root, depth, exact_ends=False)
            check_tree(shared_tree(p).root, depth, exact_ends=True)
            running[req_id] = (tokens, first, n + 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tree_depth": 0},
        {"max_cached_requests": -1},
        {"max_cached_tokens": -1},
        {"max_spec_factor": 0.0},
        {"min_token_prob": 1.5},
    ],
)
def test_bad_parameters_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SuffixProposer(**kwargs)


# ---- scopes: a tenant drafts from its own answers only -------------------------------------


def test_a_request_drafts_only_from_answers_of_its_own_scope() -> None:
    """The runner's scope is (cache_salt, adapter): salt A's answers never draft for salt B,
    nor an adapter's for the base model, as their prefix-cache blocks never meet."""
    p = SuffixProposer()
    p.start("a", ("tenant-a", None))
    run_request(p, "a", PROMPT, ANSWER)
    for req_id, scope in (("b", ("tenant-b", None)), ("plain", (None, None)),
                          ("lora", ("tenant-a", 1))):
        p.start(req_id, scope)
        assert p.propose(req_id, PROMPT + ANSWER[:1], 8) == [], scope
        assert p.propose(req_id, PROMPT + ANSWER[:12], 8) == [], scope
        p.drop(req_id)  # preempted: keeps its scope
        assert p.propose(req_id, PROMPT + ANSWER[:12], 8) == [], scope
        p.finish(req_id)
    p.start("a2", ("tenant-a", None))
    assert p.propose("a2", PROMPT + ANSWER[:1], 8) == ANSWER[1:9]  # its own tenant's: drafts
    p.finish("a2")
    assert p._scopes == {}


def test_scopes_share_the_bounds_and_leave_no_empty_trees() -> None:
    p = SuffixProposer(max_cached_requests=2)
    for i, salt in enumerate(("x", "y", "z")):
        p.start(f"r{i}", (salt, None))
        run_request(p, f"r{i}", PROMPT, ANSWER)
    assert [scope for scope, _ in p._cached] == [("y", None), ("z", None)]
    assert set(p._trees) == {("y", None), ("z", None)}  # x's last answer evicted: tree gone


# ---- the first proposal's indexing is bounded per call ------------------------------------


def test_the_first_proposal_indexes_a_long_prompt_over_several_calls(monkeypatch) -> None:
    """n requests over one long prompt reach their first proposal in the same step: each call
    indexes at most `max_index_tokens` of a request's tokens in its own tree (counted, not
    timed), and the tree drafts once it has caught up."""
    indexed: list[int] = []
    real_extend = suffix._SuffixTree._extend

    def counting(self, seq, tails, tokens):
        indexed.append(len(tokens))
        return real_extend(self, seq, tails, tokens)

    monkeypatch.setattr(suffix._SuffixTree, "_extend", counting)
    passage = list(range(4000, 4100))
    prompt = passage + list(range(5000, 7000)) + passage[:5]  # quotes its start at the end
    p = SuffixProposer(max_cached_requests=0, max_index_tokens=300)
    steps = []
    for _ in range(10):
        indexed.clear()
        drafts = [p.propose(f"n{i}", prompt, 4) for i in range(16)]  # one step of 16
        steps.append((sum(indexed), max(indexed), drafts[0]))
    assert all(most <= 300 and total <= 16 * 300 for total, most, _ in steps)
    # 2,105 tokens at 300 a call: caught up in the 8th call, drafting from then on.
    assert [draft for _, _, draft in steps] == [[]] * 7 + [passage[5:9]] * 3
    assert sum(total for total, _, _ in steps[:8]) == 16 * len(prompt)
    # Caught up, a step indexes only what is new.
    indexed.clear()
    p.propose("n0", prompt + passage[5:7], 4)
    assert sum(indexed) == 2

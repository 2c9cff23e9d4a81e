"""A seeded, randomized stress driver of the scheduler core (scheduler, KV cache manager,
block pool, disk tier index): thousands of steps of random requests (shared prefixes, prompts
at and past max_model_len, n siblings, priorities, salts, LoRA ids, grammars, prompt
logprobs) under random configurations (tiny pools that preempt, chunked prefill, async
scheduling, drafts, the disk tier, a pinned prefix), with aborts, resets, pauses and
abort_all between steps. `ShadowRunner` checks every step that each request attends to its
own prefix only; every step runs the integrity checks; at the end nothing may be left (every
block free but the pinned ones, no request anywhere) and each request's tokens, count and
finish reason must agree with its parameters.

    .venv/bin/python -m tests.core.scheduler_fuzz FIRST_SEED NUM_SEEDS STEPS

(V1_FUZZ_VERBOSE=1 prints each seed's configuration and operations.) The tests run a few
seeds (tests/core/test_scheduler_fuzz.py).
"""

import dataclasses
import os
import random
import sys
import traceback
from collections import deque
from typing import Any

from tests.core.utils import EOS, FakeGrammar, FakeManager, ShadowRunner
from v1.config import CacheConfig, SchedulerConfig
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.output import CachedRequestData
from v1.core.sched.scheduler import PauseState, Scheduler
from v1.lora.request import LoRARequest
from v1.request import EngineCoreRequest, RequestStatus
from v1.sampling_params import SamplingParams, StructuredOutputsParams

VERBOSE = os.environ.get("V1_FUZZ_VERBOSE") == "1"


class NamespacedRunner(ShadowRunner):
    """The shadow runner (its token stream 40..46 hits stop token ids; EOS on a row the
    driver picks), made aware of what else keys the KV: each request's prompt tokens are
    shifted by its namespace (cache_salt, LoRA adapter id and generation), so that a prefix
    hit across namespaces shows up as a slot holding another prefix."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ns_of: dict[str, int] = {}
        self.plen: dict[str, int] = {}

    def _enc(self, rid, toks):
        k = self.ns_of.get(rid, 0) * 10**6
        if not k:
            return list(toks)
        p = self.plen[rid]
        return [t + k if i < p else t for i, t in enumerate(toks)]

    def execute(self, out, eos_row):
        new = [dataclasses.replace(n, prompt_token_ids=self._enc(n.req_id, n.prompt_token_ids))
               for n in out.scheduled_new_reqs]
        c = out.scheduled_cached_reqs
        cached = CachedRequestData(
            list(c.req_ids), list(c.resumed_from_preemption),
            [None if t is None else self._enc(r, t)
             for r, t in zip(c.req_ids, c.resumed_token_ids)],
            c.new_block_ids, list(c.num_computed_tokens))
        return super().execute(
            dataclasses.replace(out, scheduled_new_reqs=new, scheduled_cached_reqs=cached), eos_row)


class FuzzManager(FakeManager):
    """Compilations finish at random steps (`progress`); some fail, some grammars refuse
    token 44 (`strict`), each terminates after its `length` tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.spec: dict[str, tuple[int, bool, bool]] = {}  # id -> (length, strict, fails)

    def grammar_abort(self, request: Any) -> None:
        super().grammar_abort(request)
        self.futures.pop(request.request_id, None)

    def progress(self, rng: random.Random) -> None:
        for rid in list(self.futures):
            if rng.random() < 0.3:
                future = self.futures.pop(rid)
                length, strict, fails = self.spec[rid]
                if fails:
                    future.set_exception(ValueError("bad grammar"))
                else:
                    future.set_result(FakeGrammar(length, (lambda t: t == 44) if strict
                                                  else (lambda t: False)))


def log(*a):
    if VERBOSE:
        print(*a)


def make_config(rng: random.Random):
    block_size = rng.choice([1, 2, 3, 4, 4, 4, 8, 16])
    max_model_len = rng.choice([8, 16, 17, 24, 32, 33, 40, 64])
    max_model_len = max(max_model_len, block_size + 1)
    min_blocks = -(-max_model_len // block_size)
    num_blocks = min_blocks + rng.choice([0, 0, 1, 2, 4, 8, 32])
    chunked = rng.random() < 0.85
    budget = rng.choice([1, 2, 3, 5, 8, 16, 32, 64, 128])
    if not chunked:
        budget = max(budget, max_model_len)
    policy = rng.choice(["fcfs", "priority", "priority"])
    caching = rng.random() < 0.8
    cfg = dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        chunked=chunked,
        budget=budget,
        max_num_seqs=rng.choice([1, 2, 3, 4, 8, 16]),
        threshold=rng.choice([0, 0, 1, 2, 3, 7, 16]),
        cap_lone=rng.random() < 0.3,
        policy=policy,
        async_=rng.random() < 0.4,
        caching=caching,
        spec_k=rng.choice([0, 0, 0, 1, 2, 4]),
        prefix_aware=caching and rng.random() < 0.5,
        window=rng.choice([1, 2, 4, 32]),
        max_skips=rng.choice([1, 2, 4, 16]),
        disk_blocks=(rng.choice([1, 3, 8, 64]) if caching and rng.random() < 0.3 else None),
        preload=caching and rng.random() < 0.3,
        eos_p=rng.choice([0.0, 0.05, 0.2]),
        abort_p=rng.choice([0.0, 0.05, 0.2]),
        add_p=rng.choice([0.2, 0.5, 0.9]),
        reset_p=rng.choice([0.0, 0.01, 0.05]),
        pause_p=rng.choice([0.0, 0.0, 0.03]),
        abort_all_p=rng.choice([0.0, 0.0, 0.005]),
        nonfinite_p=rng.choice([0.0, 0.0, 0.05]),
        max_loras=rng.choice([0, 0, 1, 2, 3]),
        structured_p=rng.choice([0.0, 0.0, 0.2]),
        prompt_logprobs_p=rng.choice([0.0, 0.0, 0.1]),
    )
    if cfg["disk_blocks"] is not None:
        cfg["max_loras"] = 0  # EngineArgs refuses kv_cache_dir with enable_lora
    return cfg


class Fuzzer:
    def __init__(self, seed: int, steps: int):
        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.cfg = cfg = make_config(rng)
        log("seed", seed, cfg)
        self.steps = steps
        self.bs = cfg["block_size"]
        self.mml = cfg["max_model_len"]
        tier = cfg["disk_blocks"] is not None
        self.s = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                max_model_len=self.mml, policy=cfg["policy"],
                enable_chunked_prefill=cfg["chunked"],
                long_prefill_token_threshold=cfg["threshold"], cap_lone_prefill=cfg["cap_lone"],
                async_scheduling=cfg["async_"],
                enable_prefix_aware_scheduling=cfg["prefix_aware"],
                prefix_aware_window=cfg["window"], prefix_aware_max_skips=cfg["max_skips"],
                max_loras=cfg["max_loras"],
            ),
            CacheConfig(block_size=self.bs, enable_prefix_caching=cfg["caching"],
                        preload_max_fraction=0.5),
            cfg["num_blocks"],
            disk_index=DiskBlockIndex(cfg["disk_blocks"], 1) if tier else None,
        )
        self.runner = NamespacedRunner(self.bs, cfg["spec_k"], seed, {} if tier else None)
        self.manager = FuzzManager()
        self.s.structured_output_manager = self.manager
        self.namespaces: dict[tuple, int] = {(None, None, 0): 0}
        self.lora_of: dict[str, int] = {}
        self.in_flight: deque = deque()
        self.added: dict[str, dict] = {}
        self.received: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}  # id -> finish reason
        self.aborted: set[str] = set()
        self.arrival = 1.0
        self.nid = 0
        # Shared prefixes: some block-aligned, some not.
        self.prefixes = [[]]
        for _ in range(3):
            n = rng.randint(1, max(1, self.mml - 2))
            base = rng.randint(100, 900)
            self.prefixes.append([base + i % 5 for i in range(n)])
        self.prefixes.append([7] * (self.bs * rng.randint(1, max(1, (self.mml - 1) // self.bs))))
        self.pinned_blocks = 0
        self.abort_all_ids: set[str] = set()
        self.num_steps = 0
        self.stats = dict(preempted=0, hits=0, drafts=0, resumed=0, loads=0, ignored=0,
                          aborts=0, resets=0)

    # -- requests -----------------------------------------------------------------------

    def new_id(self):
        self.nid += 1
        return f"s{self.seed}-{self.nid}"

    def random_prompt(self):
        rng, mml, bs = self.rng, self.mml, self.bs
        kind = rng.random()
        if kind < 0.1:
            n = mml - 1
        elif kind < 0.15:
            n = mml
        elif kind < 0.18:
            n = mml + rng.randint(1, 3)  # too long: ignored
        elif kind < 0.35:
            n = bs * rng.randint(1, max(1, mml // bs))
        elif kind < 0.45:
            n = 1
        else:
            n = rng.randint(1, mml)
        prefix = rng.choice(self.prefixes) if rng.random() < 0.6 else []
        prefix = prefix[:n]
        tail_base = rng.randint(1000, 100000)
        return prefix + [tail_base + i for i in range(n - len(prefix))]

    def add_requests(self):
        rng = self.rng
        prompt = self.random_prompt()
        room = max(1, self.mml - len(prompt))
        max_tokens = rng.choice([1, 1, 2, 3, 5, 8, 16, room, room + 5])
        min_tokens = rng.choice([0, 0, 0, 1, max_tokens // 2, max_tokens])
        stop_ids = rng.choice([None, None, [40], [41, 43], list(range(40, 47))])
        structured = rng.random() < self.cfg["structured_p"]
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_ids,
            ignore_eos=rng.random() < 0.15,
            prompt_logprobs=0 if rng.random() < self.cfg["prompt_logprobs_p"] else None,
            structured_outputs=StructuredOutputsParams(choice=["a", "b"]) if structured else None,
        )
        lora_id = rng.choice([None, 1, 2, 3, 4]) if self.cfg["max_loras"] else None
        gen = self.s.lora_generations.get(lora_id, 0) if lora_id else 0
        gspec = (rng.randint(1, 12), rng.random() < 0.3, rng.random() < 0.1)
        n = rng.choice([1, 1, 1, 2, 4])
        priority = rng.randint(0, 3)
        if rng.random() < 0.8:
            self.arrival += 1.0
        salt = rng.choice([None, None, None, "a", "b"])
        parent = self.new_id()
        for i in range(n):
            rid = parent if n == 1 else f"{i}_{parent}"
            req = EngineCoreRequest(
                rid, list(prompt), params, eos_token_id=EOS, arrival_time=self.arrival,
                priority=priority, cache_salt=salt,
                lora_request=LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None,
            )
            self.added[rid] = dict(prompt_len=len(prompt), max_tokens=max_tokens,
                                   min_tokens=min_tokens, stop=set(stop_ids or ()),
                                   ignore_eos=params.ignore_eos, structured=structured,
                                   grammar=gspec)
            key = (salt, lora_id, gen)
            self.runner.ns_of[rid] = self.namespaces.setdefault(key, len(self.namespaces))
            self.runner.plen[rid] = len(prompt)
            if lora_id:
                self.lora_of[rid] = lora_id
            if structured:
                self.manager.spec[rid] = gspec
            log("add", rid, len(prompt), params.max_tokens, params.min_tokens, stop_ids,
                params.ignore_eos, priority, salt)
            self.s.add_request(req)

    def pick_abort(self):
        rng, s = self.rng, self.s
        choices = []
        for rid, r in s.requests.items():
            if r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM):
                kind = "waiting-new" if r.num_preemptions == 0 else "waiting-preempted"
            elif r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                kind = "loading"
            elif r.status == RequestStatus.PREEMPTED:
                kind = "preempted"
            elif r.num_computed_tokens < r.num_prompt_tokens:
                kind = "mid-prefill"
            else:
                kind = "decode"
            choices.append((kind, rid))
        if self.finished and rng.random() < 0.2:
            choices.append(("finished", rng.choice(list(self.finished))))
        if rng.random() < 0.05:
            choices.append(("unknown", "nope"))
        if not choices:
            return
        kind, rid = rng.choice(choices)
        log("abort", kind, rid)
        self.stats["aborts"] += 1
        self.s.finish_requests([rid])
        if rid in self.added and rid not in self.finished:
            self.finished[rid] = "abort"
            self.aborted.add(rid)

    # -- steps ---------------------------------------------------------------------------

    def step(self, draining=False):
        s, rng = self.s, self.rng
        out = s.schedule()
        self.num_steps += 1
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(out.num_scheduled_tokens) <= s.max_num_seqs
        for rid, n in out.num_scheduled_tokens.items():
            assert n > 0, (rid, n)
            r = s.requests.get(rid)
            if r is not None:
                # Computed counts were advanced already; KV positions stay < max_model_len.
                assert r.num_computed_tokens <= self.mml, (r, self.mml)
        if self.cfg["max_loras"]:
            ids = {r.lora_request.lora_int_id for r in s.running if r.lora_request}
            assert len(ids) <= self.cfg["max_loras"], f"{len(ids)} adapters running: {ids}"
        if out.preempted_req_ids:
            self.stats["preempted"] += 1
        if any(r.num_computed_tokens for r in out.scheduled_new_reqs):
            self.stats["hits"] += 1
        if out.scheduled_spec_decode_tokens:
            self.stats["drafts"] += 1
        if any(out.scheduled_cached_reqs.resumed_from_preemption):
            self.stats["resumed"] += 1
        if out.kv_loads:
            self.stats["loads"] += 1
        nrows = len(out.num_scheduled_tokens)
        eos_row = rng.randrange(nrows) if nrows and rng.random() < self.cfg["eos_p"] else 99
        mo = self.runner.execute(out, eos_row)
        nonfinite_p = self.cfg["nonfinite_p"]
        if nonfinite_p and out.num_scheduled_tokens and rng.random() < nonfinite_p:
            lora_rows = [r for r in out.num_scheduled_tokens if r in self.lora_of]
            if lora_rows:
                mo.nonfinite_req_ids = [rng.choice(lora_rows)]
        self.in_flight.append((out, mo))
        s.check_integrity()
        if not s.async_scheduling or len(self.in_flight) == 2:
            self.finish_oldest()

    def finish_oldest(self):
        out, mo = self.in_flight.popleft()
        outs = self.s.update_from_output(out, mo)
        self.s.check_integrity()
        for client_outs in outs.values():
            for o in client_outs.outputs:
                rid = o.request_id
                assert rid not in self.finished or (
                    rid in self.aborted and o.finish_reason == "abort" and not o.new_token_ids
                ), f"output for finished {rid}: {o}"
                got = self.received.setdefault(rid, [])
                got.extend(o.new_token_ids)
                assert got == self.runner.sampled.get(rid, [])[: len(got)], (rid, got)
                info = self.added[rid]
                assert len(got) <= info["max_tokens"], (rid, got, info)
                assert info["prompt_len"] + len(got) <= max(self.mml, info["prompt_len"] + 1), (
                    rid, info, len(got))
                # No missed stop: each token before the last could not stop the request.
                for k, tok in enumerate(got[:-1] if o.finish_reason else got, 1):
                    if k >= info["min_tokens"]:
                        assert not (tok == EOS and not info["ignore_eos"]), (
                            f"{rid} missed EOS at output {k}: {got} {info}")
                        assert tok not in info["stop"], f"{rid} missed stop {tok}: {got} {info}"
                if o.finish_reason is None:
                    assert info["prompt_len"] + len(got) < self.mml, f"{rid} not capped"
                    assert len(got) < info["max_tokens"], f"{rid} not capped at max_tokens"
                if o.finish_reason is not None:
                    if rid in self.aborted:
                        assert o.finish_reason == "abort", o
                        continue
                    self.finished[rid] = o.finish_reason
                    if o.finish_reason == "length":
                        if not got:  # ignored
                            self.stats["ignored"] += 1
                            assert (info["prompt_len"] > self.mml
                                    or -(-info["prompt_len"] // self.bs)
                                    > self.cfg["num_blocks"] - self.pinned_blocks), (rid, info)
                        else:
                            assert (len(got) == info["max_tokens"]
                                    or info["prompt_len"] + len(got) >= self.mml), (rid, got, info)
                    elif (o.finish_reason == "stop" and info["structured"]
                          and len(got) >= info["grammar"][0] and not info["grammar"][2]):
                        self.stats["grammar_done"] = self.stats.get("grammar_done", 0) + 1
                    elif o.finish_reason == "stop":
                        assert len(got) >= info["min_tokens"], (rid, got, info)
                        last = got[-1]
                        assert (last == EOS and not info["ignore_eos"]) or last in info["stop"], (
                            rid, got, info)
                    elif o.finish_reason == "abort":
                        # abort_all: reported as aborted; or a grammar failed / rejected
                        self.aborted.add(rid)
                        if info["structured"] and rid not in self.abort_all_ids:
                            length, strict, fail = info["grammar"]
                            assert fail or strict, (rid, o)
                    else:
                        raise AssertionError(o)

    def preload(self):
        kv = self.s.kv_cache_manager
        prompt = self.rng.choice(self.prefixes[1:])
        try:
            kv.check_preload([prompt])
        except ValueError:
            return
        rid = "preload"
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        self.added[rid] = dict(prompt_len=len(prompt), max_tokens=1, min_tokens=0, stop=set(),
                               ignore_eos=True)
        self.s.add_request(EngineCoreRequest(rid, list(prompt), params, eos_token_id=EOS,
                                             arrival_time=0.5))
        self.drain()
        assert self.finished.get(rid) == "length", self.finished.get(rid)
        self.pinned_blocks = kv.pin_prefix(prompt)
        log("preloaded", len(prompt), self.pinned_blocks)

    def reset(self):
        s = self.s
        kv = s.kv_cache_manager
        pool = kv.block_pool
        reset_running = self.rng.random() < 0.5
        loading = any(r.request_id in kv.req_to_blocks for r in s.waiting) or bool(
            s.disk_tier is not None and s.disk_tier.aborted_loads)
        in_use = pool.get_num_free_blocks() + len(pool.pinned) < kv.num_blocks
        log("reset", reset_running)
        self.stats["resets"] += 1
        try:
            done = s.reset_prefix_cache(reset_running, False)
        except RuntimeError:
            assert reset_running and loading
            return
        assert done is (reset_running or not in_use), (done, reset_running, in_use)
        if done:
            assert pool.cached_block_hash_to_block == pool.pinned

    def drain(self):
        self.s.pause_state = PauseState.UNPAUSED
        for _ in range(50_000):
            if not self.s.has_requests() and not self.in_flight:
                break
            self.manager.progress(self.rng)
            if self.s.has_requests():
                self.step(draining=True)
            else:
                self.finish_oldest()
        assert not self.s.has_requests() and not self.in_flight, "did not drain"

    def run(self):
        rng, cfg, s = self.rng, self.cfg, self.s
        if cfg["preload"]:
            self.preload()
        for _ in range(self.steps):
            if rng.random() < cfg["add_p"]:
                for _ in range(rng.choice([1, 1, 2, 4])):
                    self.add_requests()
            if rng.random() < cfg["abort_p"]:
                self.pick_abort()
            if rng.random() < cfg["reset_p"]:
                self.reset()
            if rng.random() < cfg["abort_all_p"]:
                log("abort_all")
                self.abort_all_ids |= set(s.requests)
                s.abort_all()
            self.manager.progress(rng)
            if cfg["max_loras"] and rng.random() < 0.02:
                lid = rng.randint(1, 4)
                if lid not in s.lora_users:
                    log("forget_lora", lid)
                    s.forget_lora(lid)
            if rng.random() < cfg["pause_p"]:
                s.pause_state = rng.choice(list(PauseState))
                log("pause", s.pause_state)
            s.check_integrity()
            if s.has_requests():
                self.step()
            elif self.in_flight:
                self.finish_oldest()
            s.check_integrity()
        self.drain()
        self.final_checks()

    def final_checks(self):
        s = self.s
        s.check_integrity()
        kv = s.kv_cache_manager
        pool = kv.block_pool
        assert not s.requests and not s.running and not len(s.waiting), "request left"
        assert not kv.req_to_blocks, kv.req_to_blocks
        assert pool.get_num_free_blocks() + len(pool.pinned) == pool.num_blocks, "leaked blocks"
        pinned = {b.block_id for b in pool.pinned.values()}
        assert all(b.ref_cnt == (b.block_id in pinned) for b in pool.blocks)
        missing = self.added.keys() - self.finished.keys()
        assert not missing, f"never finished: {sorted(missing)[:5]}"
        if s.disk_tier is not None:
            assert not s.disk_tier.aborted_loads
        assert s.num_structured_requests == 0
        assert not s.lora_users, s.lora_users


def main():
    first = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    failures = 0
    total_steps = 0
    agg = {}
    for seed in range(first, first + count):
        f = None
        try:
            f = Fuzzer(seed, steps)
            f.run()
            total_steps += f.num_steps
            for k, v in f.stats.items():
                agg[k] = agg.get(k, 0) + v
        except Exception as e:  # a failed check: report it, go on with the next seed
            failures += 1
            print(f"SEED {seed} FAILED: {type(e).__name__}: {str(e)[:300]}")
            if f is not None:
                print("   cfg:", f.cfg)
            tb = traceback.extract_tb(e.__traceback__)
            for fr in tb[-3:]:
                print(f"   {fr.filename}:{fr.lineno} {fr.name}: {fr.line}")
    print(f"seeds {first}..{first + count - 1}: {count - failures} passed, {failures} failed, "
          f"{total_steps} steps in passing seeds")
    print("events (steps/ops) in passing seeds:", agg)


if __name__ == "__main__":
    main()

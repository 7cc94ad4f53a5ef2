"""Continuous batching (``--parallel N``): several requests generate together.

Over the real default model (``BatchEngine`` around the session's Engine): concurrent answers
equal the same requests served alone (seeded), a decode step did hold several sequences, and a
client leaving mid-stream frees its slot while the others go on. Over a thread-safe fake: N
running plus ``max_queue`` waiting, then 429.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import httpx
import numpy as np
import openai
import pytest

from sparseinfer.server.app import ServerThread, create_app

from .fake_engine import FakeEngine
from .helpers import assert_error, health, openai_client, wait_until

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "My favourite food is"]


@pytest.fixture(scope="module")
def batched(real_engine_server):
    from sparseinfer.server.batching import BatchEngine

    _, engine, *_ = real_engine_server
    be = BatchEngine(engine, parallel=4, prefill_chunk=16)
    with ServerThread(create_app(be)) as srv:
        yield srv, be
    be.close()


def test_prompt_prefix_is_reused_and_changes_nothing(batched):
    """A prompt that starts with what a free slot's cache holds (the previous request's prompt
    and answer) runs only the rest: the slot is chosen for it and the shared tokens are not run
    again; the answer is the one a batch engine that reuses nothing gives, token for token
    (seeded sampling: the reused keys and values are the bits a fresh run computes)."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import TokenEvent
    from sparseinfer.server.batching import BatchEngine

    _, be = batched
    eng = be.engine
    base = eng.encode("The history of the city of London begins")
    first = base + eng.encode(" with the Romans, who", add_bos=False)
    second = base + eng.encode(" in the year", add_bos=False)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)

    def answer(engine, ids):
        return [e.token_id for e in engine.stream(ids, params)
                if isinstance(e, TokenEvent) and e.token_id >= 0]

    fresh = BatchEngine(eng, parallel=2, prefill_chunk=16, cache_prompt=False)
    try:
        want = answer(fresh, second)
        assert fresh.reused_tokens == 0
    finally:
        fresh.close()
    answer(be, first)
    before = be.reused_tokens
    got = answer(be, second)
    assert be.reused_tokens - before == len(base)
    assert got == want and len(got) == 12


def _newcomer_beside_a_generating_stream(engine, budget):
    """A prompt that arrives while another sequence generates, on a 2-slot batch engine with
    ``budget``: (the first sequence's tokens, the newcomer's, the most rows of a step that also
    decoded, the newcomer's prompt length)."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import TokenEvent
    from sparseinfer.server.batching import BatchEngine

    first = engine.encode("Once upon a time")
    second = engine.encode("The history of the city of London begins with the Romans, who "
                           "built a bridge across the river")
    pa = SamplingParams(max_tokens=64, temperature=0.9, seed=5, ignore_eos=True)
    pb = SamplingParams(max_tokens=6, temperature=0.9, seed=6, ignore_eos=True)

    def tokens(events):
        return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]

    be = BatchEngine(engine, parallel=2, budget=budget, cache_prompt=False)
    try:
        a = be.stream(first, pa)
        got_a = tokens([next(a)])  # the first token: `first` is generating now
        got_b = tokens(be.stream(second, pb))
        return got_a + tokens(a), got_b, be.max_rows_decoding, len(second)
    finally:
        be.close()


def test_step_row_budget_runs_a_newcomers_prompt_beside_the_generating_rows(real_engine_server):
    """``RowBudget``: a prompt that arrives while another sequence generates takes only the rows
    the budget leaves in each step (budget 2: one generating row + one prompt row), where without
    a budget (``WholeChunk``) it runs as one chunk beside that row; both sequences' tokens are the
    same either way (seeded sampling: a row's numbers do not depend on what else its step runs)."""
    from sparseinfer.server.batching import RowBudget, WholeChunk

    _, engine, *_ = real_engine_server
    a0, b0, rows0, n = _newcomer_beside_a_generating_stream(engine, WholeChunk())
    a2, b2, rows2, _ = _newcomer_beside_a_generating_stream(engine, RowBudget(2))
    assert rows0 == 1 + n and rows2 == 2
    assert (a2, b2) == (a0, b0) and len(a0) == 64 and len(b0) == 6


def test_the_engine_asks_its_budget_and_tells_it_each_steps_time(real_engine_server):
    """The loop asks the budget how many prompt rows each step beside generating ones takes and
    reports every step's rows and time to it: a budget that gives 3 sees the newcomer's prompt
    in steps of 3 prompt rows (the rest last) beside the one generating row, and steps of that
    row alone before and after; the tokens are those of a whole-chunk run."""
    from sparseinfer.server.batching import PromptBudget, WholeChunk

    class Threes(PromptBudget):
        def __init__(self):
            self.seen: list[tuple[int, int, float]] = []

        def rows(self, decoding, chunk):
            return chunk if not decoding else min(chunk, 3)

        def observe(self, decoding, prompt, seconds):
            self.seen.append((decoding, prompt, seconds))

    _, engine, *_ = real_engine_server
    want = _newcomer_beside_a_generating_stream(engine, WholeChunk())
    threes = Threes()
    got = _newcomer_beside_a_generating_stream(engine, threes)
    n = got[3]
    assert got[:2] == want[:2] and got[2] == 4
    carrying = [p for d, p, _ in threes.seen if d == 1 and p]
    assert carrying == [3] * (n // 3) + ([n % 3] if n % 3 else [])
    assert any(d == 1 and p == 0 for d, p, _ in threes.seen)  # the generating row alone
    assert all(s > 0 for *_, s in threes.seen)


def test_one_step_takes_the_next_prompt_when_the_oldest_ends_within_its_rows(real_engine_server):
    """Prompt rows are taken oldest first across the waiting prompts: a step whose budget
    outlasts the oldest prompt's remaining rows goes on into the next one's (both in one step,
    each in its own slot, beside the generating row), and every sequence's tokens are those it
    gets served alone (seeded sampling)."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import TokenEvent
    from sparseinfer.server.batching import BatchEngine, PromptBudget

    class Gate(PromptBudget):  # 2 prompt rows, once the second newcomer waits; then all
        def __init__(self):
            self.calls, self.seen, self.go = 0, [], threading.Event()

        def rows(self, decoding, chunk):
            if not decoding:  # the first sequence's own prompt
                return chunk
            self.calls += 1
            if self.calls == 1:
                assert self.go.wait(60)
                return 2
            return 1000

        def observe(self, decoding, prompt, seconds):
            self.seen.append((decoding, prompt))

    _, engine, *_ = real_engine_server
    ids = [engine.encode(t) for t in ("Once upon a time", "The history of the city of London",
                                      "My favourite food is")]
    params = [SamplingParams(max_tokens=m, temperature=0.9, seed=s, ignore_eos=True)
              for m, s in ((24, 5), (6, 6), (6, 7))]

    def tokens(events):
        return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]

    alone = BatchEngine(engine, parallel=1, cache_prompt=False)
    try:
        want = [tokens(alone.stream(i, p)) for i, p in zip(ids, params)]
    finally:
        alone.close()
    gate = Gate()
    be = BatchEngine(engine, parallel=3, budget=gate, cache_prompt=False)
    try:
        a = be.stream(ids[0], params[0])
        got = [tokens([next(a)]), None, None]  # the first token: ids[0] is generating now

        def run(i):
            got[i] = tokens(be.stream(ids[i], params[i]))

        threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
        threads[0].start()
        assert wait_until(lambda: gate.calls == 1, 60)  # the first newcomer's step waits
        threads[1].start()
        assert wait_until(lambda: len(be._incoming) == 1, 60)  # the second newcomer too
        gate.go.set()
        for t in threads:
            t.join(120)
        got[0] += tokens(a)
    finally:
        be.close()
    assert got == want
    both = len(ids[1]) - 2 + len(ids[2])  # the first prompt's rest and the whole second one
    assert (1, 2) in gate.seen and (1, both) in gate.seen
    assert be.max_batch == 3


def test_time_budget_keeps_a_carrying_step_within_its_ratio_of_the_generating_steps():
    """``TimeBudget`` from the step times it is told, fitted as a line (fixed + per_row x rows):
    before it knows the line, as many prompt rows as generating ones; then the rows that keep
    the step within the ratio times the line's step of the generating rows alone, at most twice
    the last carrying step's, at least 1, at most the chunk; a whole chunk when nothing
    generates; the line follows the costs as they change."""
    from sparseinfer.server.batching import TimeBudget

    u = 1 / 1024  # times in binary fractions of a second
    b = TimeBudget(1.6)
    assert b.rows(0, 64) == 64 and b.rows(4, 64) == 4 and b.rows(4, 2) == 2
    b.observe(4, 0, 36 * u)  # 4 generating rows alone: 36 u
    assert b.line() is None and b.rows(4, 64) == 4  # one step size seen: no line yet
    b.observe(4, 2, 38 * u)  # 2 prompt rows added 2 u: the line 32 u + 1 u a row
    assert b.line() == pytest.approx((32 * u, 1 * u))
    assert b.rows(4, 64) == 4  # 0.6 x 36 u / 1 u = 21.6 rows would fit, but at most twice 2
    for p in (4, 8, 16):
        b.observe(4, p, (36 + p) * u)
    assert b.rows(4, 64) == 21 and b.rows(4, 10) == 10
    assert b.rows(9, 64) == 24  # 0.6 x (32 + 9) u / 1 u = 24.6
    b.observe(0, 40, 72 * u)  # a prompt alone on the same line: the same budget
    assert b.rows(4, 64) == 21 and b.rows(0, 64) == 64
    for i in range(600):  # slower rows now: 32 u + 3 u a row
        p = 1 + i % 4
        b.observe(4, p, (32 + 3 * (4 + p)) * u)
    assert b.line() == pytest.approx((32 * u, 3 * u), rel=0.02)
    assert b.rows(4, 64) == 8  # 0.6 x 44 u / 3 u = 8.8, within twice the last (4)
    for i in range(600):  # rows much slower: 32 u + 50 u a row
        p = 1 + i % 4
        b.observe(4, p, (32 + 50 * (4 + p)) * u)
    assert b.rows(4, 64) == 2  # 0.6 x 232 u / 50 u = 2.8
    for _ in range(600):  # every step of one size: the line is lost, as before it was known
        b.observe(4, 1, 0.25)
    assert b.line() is None and b.rows(4, 64) == 4


def test_time_budget_under_load_needs_no_step_of_the_generating_rows_alone():
    """Under load a newcomer's prompt waits at nearly every step, so steps of the generating
    rows alone are rare: the budget takes their time from the line, not from the lone stream's
    step seen first (which, standing in for 6 generating rows, charged each prompt row with
    their cost: one prompt row a step, newcomers waiting while streams ended)."""
    from sparseinfer.server.batching import TimeBudget

    u = 1 / 1024
    b = TimeBudget(3.0)
    b.observe(1, 0, 5.5 * u)  # one stream alone: 4 u + 1.5 u a row
    for p in (1, 2, 4, 8, 16):  # then 6 generating rows, a prompt at every step
        b.observe(6, p, (4 + 1.5 * (6 + p)) * u)
    assert b.rows(6, 64) == 17  # 2 x (4 + 9) u / 1.5 u = 17.3
    assert b.line() == pytest.approx((4 * u, 1.5 * u))


def test_prompt_budget_options():
    from sparseinfer.server.batching import TimeBudget, prompt_budget, RowBudget, WholeChunk

    for bad in (1.0, 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ratio: expected a finite number > 1"):
            TimeBudget(bad)
    assert isinstance(prompt_budget(), TimeBudget) and prompt_budget().ratio == 3.0
    assert prompt_budget(8, 1.5) == RowBudget(8)
    assert isinstance(prompt_budget(0, 0), WholeChunk)
    with pytest.raises(ValueError, match="step_rows: expected 0"):
        prompt_budget(-1)
    with pytest.raises(ValueError, match="step_ratio: expected 0"):
        prompt_budget(0, 0.9)


@pytest.mark.slow
def test_concurrent_answers_equal_alone(batched):
    srv, be = batched
    client = openai_client(srv, timeout=120)

    def ask(prompt: str) -> tuple[str, str, int]:
        r = client.completions.create(model=be.name, prompt=prompt, max_tokens=10,
                                      temperature=0.9, seed=11)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    alone = [ask(p) for p in PROMPTS]
    assert be.max_batch == 1
    together: list = [None] * len(PROMPTS)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    assert be.max_batch >= 2  # at least one step decoded several sequences
    assert health(srv)["running"] == 0


@pytest.mark.slow
def test_stream_cancel_frees_slot_others_continue(batched):
    srv, be = batched
    client = openai_client(srv, timeout=120)
    stream = client.chat.completions.create(
        model=be.name, messages=[{"role": "user", "content": "Tell me a long story"}],
        max_tokens=200, temperature=0, stream=True)
    it = iter(stream)
    next(it), next(it)  # role, first token
    other = client.completions.create(model=be.name, prompt="One, two,", max_tokens=6,
                                      temperature=0, stream=True)
    first = next(iter(other))
    stream.close()  # leave mid-answer
    rest = list(other)
    assert rest[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in [first] + rest if c.choices)
    assert wait_until(lambda: len(be._free) == be.parallel and health(srv)["running"] == 0, 30)


@pytest.mark.slow
def test_batched_features(batched):
    """logprobs, echo scoring, n and a grammar through the batched path."""
    srv, be = batched
    client = openai_client(srv, timeout=120)
    r = client.completions.create(model=be.name, prompt=["A", "B"], n=2, max_tokens=2,
                                  temperature=0, logprobs=1, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[0].text.startswith("A")
    assert all(len(c.logprobs.token_logprobs) >= 2 for c in r.choices)
    r = client.chat.completions.create(
        model=be.name, messages=[{"role": "user", "content": "JSON please"}], max_tokens=20,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {
                "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}})
    assert r.choices[0].message.content in ('{"ok": true}', '{"ok": false}')


def test_batched_embeddings_equal_the_engines(batched, real_engine_server):
    """``BatchEngine.embed`` (between steps, in a free slot's cache) gives ``Engine.embed``'s
    vector, also while other requests generate."""
    srv, be = batched
    engine = real_engine_server[1]
    text = "It is a truth universally acknowledged"
    want = engine.embed(engine.encode(text))  # (the batch loop is idle between tests)
    client = openai_client(srv, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(client.completions.create, model=be.name, prompt="Once upon a time",
                           max_tokens=12, temperature=0)
        got = client.embeddings.create(model=be.name, input=text).data[0].embedding
        busy.result()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


class ParallelFake(FakeEngine):
    """A fake that may be entered from several threads (no overlap lock)."""

    parallel = 2

    def _enter(self):
        return contextlib.nullcontext()


def test_parallel_capacity_and_429(start_server):
    srv, engine = start_server(ParallelFake(token_delay=0.05), max_queue=1)
    client = openai_client(srv)
    streams = []
    for tag in ("a", "b"):
        s = client.chat.completions.create(model="fake-model", max_tokens=200, stream=True,
                                           messages=[{"role": "user", "content": tag}])
        it = iter(s)
        next(it), next(it)
        streams.append(s)
    assert health(srv)["running"] == 2
    waiting = []
    t = threading.Thread(target=lambda: waiting.append(client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "c"}], max_tokens=2)))
    t.start()
    assert wait_until(lambda: health(srv)["queued"] == 1)
    assert_error(httpx.post(srv.base_url + "/completions", json={"prompt": "x"}), 429)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="fake-model", prompt="x")
    streams[0].close()
    t.join(10)
    assert waiting and waiting[0].choices[0].message.content == "one two"
    streams[1].close()
    assert wait_until(lambda: health(srv)["running"] == 0)


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])  # tiny models whose vocab = tokenizer's
def test_parallel_non_llama_equals_one_at_a_time(arch_model_dir, name):
    """``--parallel 2`` over a model with q/k norms and windows (Gemma 3) or soft-capping and
    post-norms (Gemma 2): two concurrent greedy requests, decoded in the same steps, answer what
    the one-at-a-time server answers."""
    import queue

    from sparseinfer.engine import Engine
    from sparseinfer.server.batching import BatchEngine

    engine = Engine.load(arch_model_dir(name), n_ctx=128, threads=2)
    prompts = ["Once upon a time", "The capital of France is"]  # past the 8-token window

    def ask(srv, prompt: str) -> tuple[str, str]:
        r = openai_client(srv, timeout=60).completions.create(
            model=engine.name, prompt=prompt, max_tokens=16, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason

    with ServerThread(create_app(engine)) as srv:
        alone = [ask(srv, p) for p in prompts]
    be = BatchEngine(engine, parallel=2, prefill_chunk=4)
    try:
        gate, done = threading.Event(), queue.Queue()
        with be._cv:  # hold the loop until both requests wait: they then decode together
            be._tasks.append((gate.wait, done))
            be._cv.notify()
        with ServerThread(create_app(be)) as srv:
            together: list = [None, None]
            threads = [threading.Thread(target=lambda i=i: together.__setitem__(
                i, ask(srv, prompts[i]))) for i in range(2)]
            for t in threads:
                t.start()
            assert wait_until(lambda: len(be._incoming) == 2, 30)
            gate.set()
            for t in threads:
                t.join(60)
    finally:
        be.close()
    assert together == alone
    assert be.max_batch == 2

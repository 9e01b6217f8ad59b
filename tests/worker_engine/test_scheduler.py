"""The scheduler's policy and the text stream, in pure Python (no model, no RPC)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvserve_model.resolve import resolve_model
from kvserve_model.tiny_model import TINY_MODEL_NAME
from worker.engine.lease import Lease
from worker.engine.sampling_params import Accepted, Sampled, SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Finish, Sequence, TextStream, keep_first_space
from worker.engine.speculation import NgramDrafter
from worker.engine.step import Scheduled, Step
from worker.model.sampling import RowSampler

BS = 16


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    return load(resolve_model(TINY_MODEL_NAME))


def drain(queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def make_seq(tokenizer, n_prompt: int, arrival: float, blocks: int, **params) -> Sequence:
    p = SamplingParams(**params)
    seq = Sequence(
        request_id=f"r{arrival}",
        prompt=list(range(1, n_prompt + 1)),
        params=p,
        namespace="",
        max_tokens=p.max_tokens or 100,
        arrival=arrival,
        sampler=RowSampler(p),
        text=TextStream(tokenizer.detokenizer, p.stop, p.include_stop_str_in_output),
        eos_ids=frozenset({257}),
        block_size=BS,
    )
    seq.admit(Lease(int(arrival * 10), tuple(range(blocks)), 0, ()))
    return seq


def test_decodes_first_then_padded_prefill_chunks(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    decoding = make_seq(tokenizer, 10, 0.0, 2)
    decoding.num_computed = 9  # one token left: a decode
    long_a = make_seq(tokenizer, 100, 1.0, 8)
    long_b = make_seq(tokenizer, 100, 2.0, 8)
    for seq in (decoding, long_a, long_b):
        s.running.append(seq)
    step = s.schedule()
    assert step is not None
    sizes = [(i.seq.request_id, len(i.token_ids)) for i in step.items]
    # 63 tokens left after the decode, all to the oldest prompt.
    assert sizes == [("r0.0", 1), ("r1.0", 63)]
    long_a.num_computed = 90  # 10 left: a second chunk fits if both, padded, do (2 x 31)
    step = s.schedule()
    assert step is not None
    sizes = [(i.seq.request_id, len(i.token_ids)) for i in step.items]
    assert sizes == [("r0.0", 1), ("r1.0", 10), ("r2.0", 31)]


def test_the_step_time_budget_caps_prefill_not_decodes(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    decoding = make_seq(tokenizer, 10, 0.0, 2)
    decoding.num_computed = 9
    long_a = make_seq(tokenizer, 100, 1.0, 8)
    long_b = make_seq(tokenizer, 100, 2.0, 8)
    s.running += [decoding, long_a, long_b]
    step = s.schedule(prefill_tokens=16)
    assert step is not None
    assert [(i.seq.request_id, len(i.token_ids)) for i in step.items] == [
        ("r0.0", 1),
        ("r1.0", 16),
    ]
    step = s.schedule(prefill_tokens=200)  # max_step_tokens stays the upper bound
    assert step is not None and step.num_tokens == 64


def test_the_latency_cap_holds_only_beside_decodes(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    long_a = make_seq(tokenizer, 100, 1.0, 8)
    s.running.append(long_a)
    step = s.schedule(prefill_tokens=64, beside_decodes=16)  # nothing decodes: all 64
    assert step is not None and [len(i.token_ids) for i in step.items] == [64]
    decoding = make_seq(tokenizer, 10, 0.0, 2)
    decoding.num_computed = 9
    s.running.insert(0, decoding)
    step = s.schedule(prefill_tokens=64, beside_decodes=16)
    assert step is not None
    assert [(i.seq.request_id, len(i.token_ids)) for i in step.items] == [
        ("r0.0", 1),
        ("r1.0", 16),
    ]


def test_a_sequence_without_room_waits_for_its_extension(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    seq = make_seq(tokenizer, 16, 0.0, 1)
    seq.num_computed = 16
    seq.output = [5]  # token 17 needs a second block
    s.running.append(seq)
    assert s.schedule() is None
    seq.block_table.append(7)
    step = s.schedule()
    assert step is not None and step.items[0].token_ids == [5]


def test_postprocess_finishes_on_eos_stop_token_and_length(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    eos = make_seq(tokenizer, 4, 0.0, 1)
    stop_id = make_seq(tokenizer, 4, 1.0, 1, stop_token_ids=(42,))
    length = make_seq(tokenizer, 4, 2.0, 1, max_tokens=1)
    ignore = make_seq(tokenizer, 4, 3.0, 1, ignore_eos=True)
    s.running.extend([eos, stop_id, length, ignore])
    step = s.schedule()
    assert step is not None
    done = s.postprocess(step, [Sampled(257), Sampled(42), Sampled(65), Sampled(257)])
    assert done == [eos, stop_id, length]
    assert s.running == [ignore]
    events = [seq.out.get_nowait() for seq in (eos, stop_id, length)]
    assert [e.finish for e in events] == [Finish.STOP, Finish.STOP, Finish.LENGTH]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(tokenizer, include: bool) -> None:
    """With special tokens kept (none hidden here), EOS wrote "<|im_end|>" into the content;
    vLLM leaves the text of the token that stopped the output out unless
    include_stop_str_in_output, and so does this."""
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    eos = make_seq(tokenizer, 4, 0.0, 1, include_stop_str_in_output=include)
    stop_id = make_seq(
        tokenizer, 4, 1.0, 1, stop_token_ids=(42,), include_stop_str_in_output=include
    )
    s.running.extend([eos, stop_id])
    step = s.schedule()
    assert step is not None
    assert s.postprocess(step, [Sampled(65), Sampled(65)]) == []
    step = s.schedule()
    assert step is not None
    assert s.postprocess(step, [Sampled(257), Sampled(42)]) == [eos, stop_id]
    texts = ["".join(e.text for e in drain(seq.out)) for seq in (eos, stop_id)]
    assert eos.output == [65, 257] and stop_id.output == [65, 42]  # the tokens stay
    eos_text = tokenizer.decode([257])
    assert eos_text and eos_text != "A"
    assert texts == (["A" + eos_text, "A*"] if include else ["A", "A"])


def test_text_stream_holds_back_a_possible_stop_string(tokenizer) -> None:
    stream = TextStream(tokenizer.detokenizer, ("END",), include_stop=False)
    out = []
    for ch in b"abcEN":
        text, hit = stream.add(ch)
        assert not hit
        out.append(text)
    assert "".join(out) == "abc"  # "EN" may start "END"
    text, hit = stream.add(ord("D"))
    assert hit and text == ""


def test_text_stream_never_splits_a_utf8_character(tokenizer) -> None:
    stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
    pieces = [stream.add(b)[0] for b in "é€".encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == "é€"


def test_an_output_cut_within_a_character_ends_before_it(tokenizer) -> None:
    """An output whose last token ends partway into a UTF-8 character (cut by max_tokens) ends
    with the characters before it, not with U+FFFD for the unfinished bytes; a character the
    tokens complete stays, and so does an invalid byte within the text."""
    whole = "aé€😀".encode()
    for cut in range(1, len(whole) + 1):
        stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
        sent = "".join(stream.add(b)[0] for b in whole[:cut]) + stream.finish()
        assert sent == whole[:cut].decode(errors="ignore"), cut
    for invalid in (b"a\xffb", b"a\x80\x80", b"\x80", b"a\xff", b"\xe2\x82\xe2"):
        # invalid bytes stay U+FFFD, as in the whole decode; only an unfinished end goes
        stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
        sent = "".join(stream.add(b)[0] for b in invalid) + stream.finish()
        whole = invalid.decode(errors="replace")
        assert sent == (whole[:-1] if invalid.endswith(b"\xe2") else whole), invalid


def test_text_stream_sends_spaces_as_they_come(tokenizer) -> None:
    """mlx-lm's byte-level detokenizer holds each space until the next token; once the text has
    begun nothing is trimmed, so a run of spaces streams as it is generated (a request whose
    output was 256 spaces used to get all of them with its last token)."""
    stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
    assert stream.add(ord("a"))[0] == "a"
    assert [stream.add(ord(" "))[0] for _ in range(3)] == [" ", " ", " "]
    assert stream.add(ord("b"))[0] == "b"


def test_text_stream_sends_leading_spaces_as_they_come(tokenizer) -> None:
    """An output that opens with spaces keeps them all (mlx-lm trims the first: a completion
    of "The capital of France is" read "Paris."), each sent as it comes (a request whose
    greedy output was 256 spaces got its first text with its last token)."""
    stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
    assert [stream.add(ord(" "))[0] for _ in range(4)] == [" ", " ", " ", " "]
    assert stream.add(ord("b"))[0] == "b"
    assert stream.finish() == ""


@pytest.mark.parametrize("model", ["default", "tiny"])
def test_an_outputs_text_is_its_tokens_text(model: str) -> None:
    """The text of an output whose first token opens with a space (" Paris") is the tokens'
    own, as the logprobs' tokens and text offsets say, on the default model's real tokenizer
    (byte-level BPE) and the tiny one."""
    from mlx_lm.tokenizer_utils import load

    from kvserve_model.default_model import DEFAULT_MODEL_NAME

    tok = load(resolve_model(DEFAULT_MODEL_NAME if model == "default" else TINY_MODEL_NAME))
    ids = tok.encode(" Paris is, in  fact, the capital.", add_special_tokens=False)
    stream = TextStream(tok.detokenizer, (), include_stop=False)
    sent = "".join(stream.add(t)[0] for t in ids) + stream.finish()
    assert sent == tok.decode(ids) == " Paris is, in  fact, the capital."


@pytest.mark.parametrize("seed", range(20))
def test_text_stream_ends_with_mlx_lms_text(tokenizer, seed) -> None:
    """Whatever the stream sends early, its text in the end is mlx-lm's own detokenizer's
    (told to keep a leading space, as the stream's is) and the tokens' whole decode: random
    tokens, spaces (leading ones too), newlines, multi-byte UTF-8."""
    rng = np.random.default_rng(seed)
    pieces = [" ", " ", "  ", "a", "Z", "\n", "é", "€", "😀", ".", "x y"]
    text = "".join(rng.choice(pieces) for _ in range(int(rng.integers(1, 40))))
    ids = tokenizer.encode(text, add_special_tokens=False)
    reference = keep_first_space(tokenizer.detokenizer)
    for t in ids:
        reference.add_token(t)
    reference.finalize()
    stream = TextStream(tokenizer.detokenizer, (), include_stop=False)
    sent = "".join(stream.add(t)[0] for t in ids) + stream.finish()
    assert sent == reference.text == text


def test_token_slice_matches_the_token_list(tokenizer) -> None:
    seq = make_seq(tokenizer, 5, 0.0, 1)
    seq.output = [50, 51, 52]
    for start in range(8):
        for n in range(1, 5):
            assert seq.token_slice(start, n) == seq.tokens[start : start + n]


def test_speculative_decodes_draft_within_slots_tokens_and_context(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    # A prompt that repeats, so prompt lookup proposes its continuation.
    seq = make_seq(tokenizer, 0, 0.0, 2, max_tokens=20, speculative="ngram")
    seq.prompt = [5, 6, 7, 8] * 4 + [5, 6]
    seq.num_draft = 4
    seq.drafter = NgramDrafter()
    seq.num_computed = len(seq.prompt) - 1
    s.running.append(seq)
    step = s.schedule()
    assert step is not None
    (item,) = step.items
    assert (item.token_ids, item.drafts, item.samples) == ([6, 7, 8, 5, 6], (7, 8, 5, 6), True)
    # Two slots left in the lease: one for the last token, one draft.
    seq.block_table = [0, 1]
    seq.num_computed = 30
    seq.output = [7] * 12
    assert s.draft_room(seq) == 1
    # One token left to max_tokens: no draft (it could not be kept).
    seq.block_table = list(range(8))
    seq.output = [7] * 19
    seq.num_computed = seq.num_tokens - 1
    assert s.draft_room(seq) == 0
    # Verdicts are taken token by token: the first that finishes the request is its last.
    seq.output = [7] * 10
    seq.num_computed = seq.num_tokens - 1
    start = seq.num_computed
    verdict = Accepted((Sampled(7), Sampled(257), Sampled(7)), drafts=2)
    item = Scheduled(seq, start, [7, 7, 257], tuple(seq.block_table), seq.lease.lease_id, (7, 257))
    finished = s.postprocess(Step([item], []), [verdict])
    assert finished == [seq] and seq.output[-2:] == [7, 257]
    assert seq.num_computed == seq.num_tokens - 1
    assert (seq.draft_tokens, seq.accepted_drafts) == (2, 2)


def naive_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for j in range(end - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_prompt_lookup_matches_a_naive_search(seed: int) -> None:
    rng = random.Random(seed)
    max_n, min_n = rng.choice([(4, 2), (3, 1), (2, 2), (5, 3)])
    drafter = NgramDrafter(max_n, min_n)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
    for _ in range(60):
        k = rng.randrange(0, 6)
        drafter.extend(tokens[drafter.seen :])
        assert drafter.propose(k) == naive_propose(tokens, k, max_n, min_n), tokens
        tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_a_sequence_whose_drafts_are_rarely_kept_drafts_only_to_probe(tokenizer) -> None:
    s = Scheduler(max_batch_size=8, max_step_tokens=64, max_context=4096)
    seq = make_seq(tokenizer, 10, 0.0, 8, max_tokens=100, speculative="draft_model")
    seq.num_draft = 4
    seq.num_computed = 9
    assert s.draft_room(seq) == 4
    for n in range(1, 6):  # verdicts keeping nothing pull its acceptance down
        seq.output = [7] * n
        seq.num_computed = seq.num_tokens - 1
        item = Scheduled(seq, seq.num_computed, [7, 1, 2, 3, 4], tuple(seq.block_table), 0, (), 4)
        s.postprocess(Step([item], []), [Accepted((Sampled(9),), drafts=4)])
    assert seq.acceptance < 0.25
    rooms = []
    for n in range(16, 32):
        seq.output = [7] * n
        seq.num_computed = seq.num_tokens - 1
        rooms.append(s.draft_room(seq))
    assert rooms.count(0) == 14 and rooms.count(4) == 2  # one decode in 8 probes
    # Kept drafts bring it back.
    for _ in range(6):
        seq.output.append(7)
        seq.num_computed = seq.num_tokens - 1
        item = Scheduled(seq, seq.num_computed, [7, 1, 2], tuple(seq.block_table), 0, (), 2)
        s.postprocess(Step([item], []), [Accepted((Sampled(1), Sampled(2), Sampled(3)), drafts=2)])
    assert seq.acceptance > 0.25


def test_draft_model_steps_draft_the_way_that_measured_faster(tokenizer) -> None:
    """Whether draft-model requests draft is measured per batch size: each way is tried first,
    then the faster kept, the other probed one step in PROBE_EVERY; batch sizes apart."""
    from worker.engine.step_budget import ForwardTime

    s = Scheduler(max_batch_size=8, max_step_tokens=256, max_context=4096)

    def decoding(n: int, **params) -> None:
        seqs = []
        for i in range(n):
            seq = make_seq(tokenizer, 10, float(i), 8, max_tokens=100, **params)
            seq.num_draft = 4
            seq.num_computed = 9
            seqs.append(seq)
        s.running = seqs

    def step(tokens_per_s: float | None = None) -> bool:
        """One step; with a rate, its postprocess and timing as the engine feeds them."""
        st = s.schedule()
        assert st is not None
        drafted = any(item.draft_slots for item in st.items)
        assert all(bool(item.draft_slots) == drafted for item in st.items)
        if tokens_per_s is not None:
            s.postprocess(st, [Sampled(5)] * len(st.items))  # one token each
            s.observe(ForwardTime(len(st.items) / tokens_per_s, 0.0, 0))
            for item in st.items:  # back to a decode of the same shape
                item.seq.output.clear()
                item.seq.num_computed = 9
                item.seq.status = item.seq.status.RUNNING
            s.running = [item.seq for item in st.items]
        return drafted

    decoding(8, speculative="draft_model")
    assert step(500.0) is True  # unmeasured: drafting first
    assert step(900.0) is False  # then without
    choices = [step(500.0 if d else 900.0) for d in [False] * 16]
    assert choices.count(True) == 2  # the slower way, probed one step in PROBE_EVERY
    decoding(1, speculative="draft_model")  # another batch size: measured afresh
    assert step(480.0) is True and step(260.0) is False
    assert [step() for _ in range(3)] == [True] * 3  # one stream: drafting measured faster
    decoding(8, speculative="ngram")  # prompt lookup costs no model time: never held back
    for seq in s.running:
        seq.prompt[:] = [1, 2, 3] * 3 + [1]  # a repeat for it to find
        seq.drafter = NgramDrafter()
    st = s.schedule()
    assert st is not None and all(item.drafts for item in st.items)


def test_the_admission_timeout_counts_from_the_last_released_lease(tokenizer) -> None:
    """A request waits at most ``limit`` without room *while no lease comes back*: a queue
    that moves gets its turn (a request with n=16 choices of a long prompt, three fitting at
    once, had its later choices end after 120 s while the first ones were finishing); room
    that never comes back still ends it. Randomized against a naive reading of the rule."""
    from worker.engine.admission import overdue

    rng = random.Random(7)
    for _ in range(200):
        limit = rng.choice([0.0, 1.0, 5.0, 120.0])
        now = 1000.0
        freed_at = rng.choice([float("-inf"), now - rng.uniform(0, 300)])
        seqs = []
        for i in range(rng.randrange(1, 6)):
            s = make_seq(tokenizer, 4, float(i), 1)
            s.no_room_since = rng.choice([None, now - rng.uniform(0, 300)])
            seqs.append(s)
        got = [s for s, _ in overdue(seqs, now, limit, freed_at)]
        want = [
            s
            for s in seqs
            if limit
            and s.no_room_since is not None
            and now - s.no_room_since >= limit
            and now - freed_at >= limit
        ]
        assert got == want
    stuck = make_seq(tokenizer, 4, 0.0, 1)
    stuck.no_room_since = 0.0
    assert overdue([stuck], 300.0, 120.0, freed_at=250.0) == []  # leases came back 50 s ago
    assert overdue([stuck], 300.0, 120.0, freed_at=100.0) == [(stuck, 300.0)]

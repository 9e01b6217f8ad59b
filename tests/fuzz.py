"""Fuzzing helpers shared by the gRPC and REST fuzz tests.

``messages(cls)`` is a hypothesis strategy for any protobuf message, built by walking
``DESCRIPTOR.fields``: a field added to a proto is fuzzed with no change here. Every scalar
draws from its whole wire range with the edges (0, -1, the type's min and max, NaN, the
infinities) weighted in; enums draw unknown numbers too; a oneof sets at most one member;
sub-messages recurse to a bounded depth. ``hints`` (field name -> strategy) mixes in values
that get past the first checks (a registered pool id, a live lease id) so the fuzz reaches the
code behind them.

``LoopThread`` runs the servers under test in an event loop on a thread of their own, so a
plain (synchronous) hypothesis test can call them with the blocking gRPC and HTTP clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve_proto.worker.v1 import worker_pb2 as worker_pb

T = TypeVar("T")
F = FieldDescriptor

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(-3, 300).filter(lambda v: lo <= v <= hi))


def _ints_wide(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(_ints(lo, hi), st.integers(lo, hi))


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 3.4e38]
    return st.one_of(st.sampled_from(edges), st.floats(width=width), st.floats(-2.0, 2.0))


# Text with no lone surrogates (protobuf refuses them on assignment, before any wire).
_CHARS = st.characters(exclude_categories=("Cs",))
STRINGS = st.one_of(
    st.just(""),
    st.text(_CHARS, max_size=40),
    st.sampled_from(["\x00", "../../etc", "%s%n", "\u202e", "a" * 300, "ns/with/slashes"]),
    st.integers(1_000, 20_000).map(lambda n: "x" * n),  # large inputs: test_hostile_input
)


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return _ints_wide(*INT32)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return _ints_wide(*INT64)
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return _ints_wide(*UINT32)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return _ints_wide(*UINT64)
    if t == F.TYPE_FLOAT:
        return _floats(32)
    if t == F.TYPE_DOUBLE:
        return _floats(64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return STRINGS
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers go on the wire as they are
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints_wide(*INT32))
    raise TypeError(f"no strategy for field type {t} ({field.full_name})")


def _repeated(field: FieldDescriptor, one: st.SearchStrategy[Any]) -> st.SearchStrategy[list]:
    many = st.lists(one, max_size=12)
    if field.type == F.TYPE_MESSAGE:
        return many
    # Long lists of one value: a size the handler must bound, not a shape it must parse. Strings
    # in them stay short: 50,000 copies of a 20,000-character string is a 1 GB message, and
    # the mutations below repeat a message up to 50 times (the test process once asked for
    # 28 GB and was killed); the handlers' size limits have tests of their own.
    if field.type == F.TYPE_STRING:
        one = st.text(_CHARS, max_size=64)
    elif field.type == F.TYPE_BYTES:
        one = st.binary(max_size=64)
    return st.one_of(many, st.tuples(one, st.integers(1_000, 50_000)).map(lambda p: [p[0]] * p[1]))


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _map(field: FieldDescriptor) -> st.SearchStrategy[dict]:
    """A map field's entries: its key and value types' scalars (a long map bounds like a long
    list)."""
    key, value = (
        field.message_type.fields_by_name["key"],
        field.message_type.fields_by_name["value"],
    )
    small = st.dictionaries(scalar(key), scalar(value), max_size=12)
    return st.one_of(
        small, st.dictionaries(scalar(key), scalar(value), min_size=500, max_size=2_000)
    )


def _field(
    field: FieldDescriptor, hints: Mapping[str, st.SearchStrategy[Any]], depth: int
) -> st.SearchStrategy[Any]:
    if _is_map(field):
        return hints[field.name] if field.name in hints else _map(field)
    if field.type == F.TYPE_MESSAGE:
        one: st.SearchStrategy[Any] = _message(field.message_type, hints, depth + 1)
    else:
        one = scalar(field)
    if field.name in hints:  # half the time a value that passes the first checks
        one = st.one_of(hints[field.name], one)
    if field.is_repeated:
        return _repeated(field, one)
    return one


def _message(
    desc: Descriptor, hints: Mapping[str, st.SearchStrategy[Any]], depth: int
) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    # A oneof (and a proto3 `optional`, a synthetic oneof) sets at most one of its members.
    groups = [[f.name for f in o.fields] for o in desc.oneofs]
    grouped = {name for g in groups for name in g}
    plain = {f.name: st.none() | _field(f, hints, depth) for f in desc.fields}

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        chosen = {draw(st.sampled_from([None, *g])) for g in groups}
        values: dict[str, Any] = {}
        for f in desc.fields:
            if f.name in grouped and f.name not in chosen:
                continue
            v = draw(plain[f.name])
            if v is not None:
                values[f.name] = v
        msg = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            if _is_map(f):
                getattr(msg, name).update(v)
            elif f.is_repeated:
                getattr(msg, name).extend(v)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return build()


def messages(
    cls: type[Message], hints: Mapping[str, st.SearchStrategy[Any]] | None = None
) -> st.SearchStrategy[Message]:
    return _message(cls.DESCRIPTOR, hints or {}, 0)


class LoopThread:
    """An event loop on a daemon thread; async context managers entered on it stay open
    until ``close``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro: Awaitable[T], timeout: float = 120) -> T:
        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def enter(self, cm: contextlib.AbstractAsyncContextManager[T]) -> T:
        return self.run(self.stack.enter_async_context(cm))

    def close(self) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@dataclass(frozen=True)
class Rpc:
    """One method of a service, from its descriptor."""

    path: str
    request: type[Message]
    response: type[Message]
    streaming: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def rpcs(service: ServiceDescriptor) -> list[Rpc]:
    return [
        Rpc(
            f"/{service.full_name}/{m.name}",
            message_factory.GetMessageClass(m.input_type),
            message_factory.GetMessageClass(m.output_type),
            m.server_streaming,
        )
        for m in service.methods
    ]


def invoke(
    channel: grpc.Channel,
    rpc: Rpc,
    request: Message | bytes,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 10,
    max_responses: int = 0,
) -> tuple[grpc.StatusCode, list[Any], str]:
    """Calls ``rpc`` (``request`` as bytes: sent as they are, unparsed); returns the status,
    the responses and the status details. ``max_responses`` (streams): cancel the call after
    that many responses, as a client that stops reading does (OK, with what it read)."""
    raw = isinstance(request, bytes)
    ser = None if raw else rpc.request.SerializeToString
    de = None if raw else rpc.response.FromString
    try:
        if rpc.streaming:
            call = channel.unary_stream(rpc.path, request_serializer=ser, response_deserializer=de)(
                request, metadata=list(metadata), timeout=timeout
            )
            out = []
            for response in call:
                out.append(response)
                if len(out) == max_responses:
                    call.cancel()
                    break
        else:
            out = [
                channel.unary_unary(rpc.path, request_serializer=ser, response_deserializer=de)(
                    request, metadata=list(metadata), timeout=timeout
                )
            ]
    except grpc.RpcError as e:
        return e.code(), [], e.details() or ""
    return grpc.StatusCode.OK, out, ""


def mutated(good: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and a valid message's bytes with a few flipped, cut or repeated."""

    @st.composite
    def flip(draw: st.DrawFn) -> bytes:
        b = bytearray(good)
        for _ in range(draw(st.integers(1, 4))):
            if b:
                b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        return bytes(b)

    return st.one_of(
        st.binary(max_size=512),
        flip(),
        st.integers(0, max(len(good) - 1, 0)).map(lambda n: good[:n]),
        # Repeated up to 50 times, at most ~8 MB (twice the servers' default message limit).
        st.integers(2, 50).map(lambda n: good * max(2, min(n, (8 << 20) // max(len(good), 1)))),
        st.sampled_from([b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10]),
    )


def budget(n: int) -> settings:
    """``n`` examples from a fixed seed: the default run tries the same inputs every time."""
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


# -- worker.v1.Worker: the gateway's gRPC edge and the worker's own --------------------------

GENERATE_HINTS: dict[str, st.SearchStrategy] = {
    "prompt_text": st.sampled_from(["Hello", "Hi there", " ", "\x00"]),
    "ids": st.integers(0, 255),
    "max_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1),
    "logprobs": st.integers(0, 5),
    "repetition_penalty": st.floats(0.5, 2),
    "namespace": st.sampled_from(["", "a", "tenant-1"]),
}


class WorkerTarget(Protocol):
    def call(self, name: str, request: Any) -> None:
        """Calls the RPC ``name``; asserts the status is one the edge may answer."""

    def settle(self) -> None:
        """Asserts the server is unharmed: it serves a good request, nothing is held."""


def fuzz_worker_messages(target: WorkerTarget, n: int) -> None:
    """``n`` Generate (9 in 10) and GetInfo messages from the descriptors, then settle."""
    generate = messages(worker_pb.GenerateRequest, GENERATE_HINTS)
    info = messages(worker_pb.GetInfoRequest)

    @budget(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9)) == 0:
            target.call("GetInfo", data.draw(info))
        else:
            target.call("Generate", data.draw(generate))

    run()
    target.settle()


def fuzz_worker_bytes(target: WorkerTarget, n: int) -> None:
    """``n`` Generate calls whose bytes are random or a good message mutated, then settle."""

    @budget(n)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        good = data.draw(messages(worker_pb.GenerateRequest, GENERATE_HINTS)).SerializeToString()
        target.call("Generate", data.draw(mutated(good)))

    run()
    target.settle()


def many_requests() -> st.SearchStrategy[list[Message]]:
    """One GenerateMany call's messages: starts from the descriptors, cancels, stream numbers
    that collide or were never started, and an empty action now and then; and a well-formed
    sampled start now and then, so that streams run the model among the rest (of the
    descriptors' starts, few pass the edge: one run streamed 3 tokens in 200 calls)."""
    generate = messages(worker_pb.GenerateRequest, GENERATE_HINTS)
    stream = st.integers(0, 4) | st.integers(0, 2**64 - 1)
    start = st.builds(
        lambda n, r: worker_pb.GenerateManyRequest(stream=n, start=r), stream, generate
    )
    sound = st.builds(
        lambda n, ids, t, p: worker_pb.GenerateManyRequest(
            stream=n,
            start=worker_pb.GenerateRequest(
                prompt_token_ids=worker_pb.TokenIds(ids=ids),
                sampling=worker_pb.SamplingParams(
                    max_tokens=2, temperature=t, top_p=p, ignore_eos=True
                ),
            ),
        ),
        stream,
        st.lists(st.integers(3, 250), min_size=1, max_size=12),
        st.floats(0, 2),
        st.floats(0.05, 1),
    )
    cancel = st.builds(lambda n: worker_pb.GenerateManyRequest(stream=n, cancel=True), stream)
    empty = st.builds(lambda n: worker_pb.GenerateManyRequest(stream=n), stream)
    one = st.one_of(*[start, start, start, cancel, empty] * 2, sound)  # one in 11 well-formed
    return st.lists(one, min_size=1, max_size=6)


def fuzz_worker_sessions(target: WorkerSessionTarget, n: int) -> None:
    """``n`` GenerateMany calls of a few messages each, then settle."""

    @budget(n)
    @given(many_requests())
    def run(msgs: list[Message]) -> None:
        target.call_many(msgs)

    run()
    target.settle()


class WorkerSessionTarget(WorkerTarget, Protocol):
    def call_many(self, msgs: Sequence[Message]) -> None:
        """Sends ``msgs`` on one GenerateMany call; asserts the call's status and every
        request's error are ones the edge may answer."""

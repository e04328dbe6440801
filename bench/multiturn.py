"""Multi-turn conversations for bench/prefix_affinity.py's ``multiturn`` workload: ``n`` conversations
at once, each ``turns`` turns long, each turn a streaming chat ``Generate`` whose messages are the
whole conversation so far (the opening document and question, then every answer and the next
question), so a turn's prompt is the last turn's prompt plus its answer. A conversation sends its
next turn only once the last one has ended, as a chat client does.

Answers are ``max_tokens`` long (``ignore_eos``), or with ``spread`` > 0 drawn per turn from
``max_tokens`` * [1 - spread, 1 + spread], the same draw for every run of one seed: real answers
differ in length, and answers of one length keep conversations that started together in step,
every turn of them reaching the engine in the same instant.

Every turn carries ``prefix_key`` = its conversation's id: with affinity on, the gateway routes a
conversation's turns to the worker that served (and cached) the last one; with affinity off the
key is ignored and any worker takes any turn. Records are bench/load.py's, plus the turn number.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
from load import stream_one  # bench/ is on the path of `python bench/prefix_affinity.py`

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc

# Short follow-ups, one per turn after the first (cycled past the end).
FOLLOW_UPS = (
    "Can you say more about that?",
    "Which part of it matters most, and why?",
    "Give an example.",
    "What would someone who disagrees say?",
    "Summarise what we have said so far.",
    "What should I read next?",
    "Explain it to a child.",
    "What is the one thing to remember?",
)


def openings(docs: list[str], questions: tuple[str, ...]) -> list[str]:
    """The first user message of each conversation: a document and a question about it."""
    return [f"{doc}\n\nQuestion: {questions[i % len(questions)]}" for i, doc in enumerate(docs)]


def answer_tokens(max_tokens: int, spread: float, seed: int, cid: int, turn: int) -> int:
    """The length of one answer: ``max_tokens``, or with ``spread`` a fixed draw around it."""
    if spread <= 0:
        return max_tokens
    lo, hi = max(1, round(max_tokens * (1 - spread))), max(1, round(max_tokens * (1 + spread)))
    return random.Random(f"{seed}-{cid}-{turn}").randint(lo, hi)


async def _conversation(
    stub: Any, cid: int, opening: str, turns: int, lengths: tuple[int, float, int], rec: list[dict]
) -> None:
    messages = [pb.ChatMessage(role="user", content=opening)]
    for turn in range(turns):
        if turn:
            messages.append(pb.ChatMessage(role="user", content=FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]))
        req = pb.GenerateRequest(
            messages=messages,
            max_tokens=answer_tokens(*lengths, cid, turn),
            ignore_eos=True,
            prefix_key=f"conversation-{cid}",
        )
        r, answer = await stream_one(stub, req)
        rec.append(r | {"turn": turn})
        messages.append(pb.ChatMessage(role="assistant", content=answer))


async def run_conversations(
    target: str, opening: list[str], turns: int, max_tokens: int, spread: float = 0.0, seed: int = 0
) -> dict:
    """Every conversation at once (their number is the concurrency), each turn after the last;
    returns bench/load.py's ``{"t0", "rec"}``."""
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, len(opening) // 32))
    ]
    stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in channels]
    try:
        rec: list[dict] = []
        t0 = time.perf_counter()
        lengths = (max_tokens, spread, seed)
        await asyncio.gather(
            *(_conversation(stubs[i % len(stubs)], i, o, turns, lengths, rec) for i, o in enumerate(opening))
        )
        return {"t0": t0, "rec": rec}
    finally:
        for c in channels:
            await c.close()

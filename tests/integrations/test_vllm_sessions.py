"""vLLM's streaming-input sessions (resumable requests) over the stand-in engine of
``vllm_engine``: a session stops after a turn, keeps its blocks and its request id, and comes
back with its prompt extended by the next chunk, which may bring its own multimodal items
(``Scheduler._update_request_as_session``). It is scheduled as a new request again, with the
tokens computed so far."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.integrations.test_vllm_adapter import Halves, extra
from tests.integrations.test_vllm_adapter import prompt as tokens
from tests.integrations.vllm_engine import Engine


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


FIRST, IMAGE = tokens(9, 1), [7] * 8  # the second chunk: an image's placeholder tokens, then text
SECOND = IMAGE + tokens(3, 2)


def image(name: str, offset: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=name, mm_position=SimpleNamespace(offset=offset))


class Matches:
    """The scheduler half, recording what it promised each request."""

    def __init__(self, sched) -> None:
        self.sched, self.promised = sched, {}

    def get_num_new_matched_tokens(self, request, computed):
        n, is_async = self.sched.get_num_new_matched_tokens(request, computed)
        self.promised.setdefault(request.request_id, []).append(n)
        return n, is_async

    def __getattr__(self, name):
        return getattr(self.sched, name)


def session(eng: Engine, rid: str, second_image: str):
    """A session whose first turn reads FIRST (with image "chart" in it) and whose second chunk
    brings ``second_image``; it is left decoding its second turn."""
    req = eng.add(rid, FIRST, max_tokens=50)
    req.mm_features = [image("chart", 0)]
    while req.num_computed_tokens < len(FIRST):
        eng.step()
    # the turn stops: vLLM keeps the computed tokens, drops the last sampled one, and appends the
    # next chunk with its image (offset past what the session holds)
    eng.running.remove(req)
    del req._all[req.num_computed_tokens:]
    req.mm_features.append(image(second_image, len(req._all)))
    req.prompt_token_ids = req._all[:] + SECOND
    req._all.extend(SECOND)
    req.num_prompt_tokens = len(req.prompt_token_ids)
    req.status = "WAITING"
    eng.waiting.append(req)
    while req.num_computed_tokens < req.num_prompt_tokens + 1:
        eng.step()
    return req


def test_a_session_whose_next_chunk_brings_another_image_is_not_promised_kv_computed_over_the_first(tmp_path):
    """Keys folded in the session's first chunk's images alone; the blocks of its second chunk,
    an image's placeholder tokens, were saved under them. Another session that differs only by
    that image was promised them when preempted, and read KV computed over the other image."""
    halves = Halves(extra(tmp_path))
    try:
        matches = Matches(halves.sched)
        eng = Engine(matches, halves.worker)
        session(eng, "a", "cat")  # its blocks are stored
        b = session(eng, "b", "dog")
        eng.preempt_at[eng.steps + 1] = "b"
        while len(matches.promised["b"]) < 2 or b.num_computed_tokens < b.num_prompt_tokens:
            eng.step()
        first_of_second_chunk = len(FIRST) // 4 * 4
        assert max(matches.promised["b"][1:]) <= first_of_second_chunk
        eng.run(max_steps=eng.steps + 400)  # both finish: held until their saves are reported
        assert not eng.held
    finally:
        halves.close()

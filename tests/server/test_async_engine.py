"""AsyncEngine on its own: streams, refusals, cancellation, overload."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from inferd.config import make_engine_config
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.engine import Engine
from inferd.errors import EngineOverloadedError, InvalidRequestError
from inferd.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    return Engine(make_engine_config(str(tiny_models["llama"]), max_model_len=256, kv_cache_memory=16 << 20))


def test_streams_refusals_and_cancellation(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting_requests=0)
        ae.start()
        try:
            outs = [o async for o in ae.generate("a", [5, 6, 7], params)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
            assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
            with pytest.raises(InvalidRequestError) as e:
                await ae.add_request("b", [5] * 300, params)
            assert e.value.param == "prompt"
            # a consumer that stops early aborts its request
            agen = ae.generate("c", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            # cancelled while still queued: the engine must not keep it
            task = asyncio.create_task(ae.add_request("d", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not engine.has_unfinished_requests() and not ae.num_in_flight:
                    break
                await asyncio.sleep(0.01)
            engine.check_idle()
            ae.start_drain()
            with pytest.raises(EngineOverloadedError):
                await ae.add_request("e", [5], params)
        finally:
            await ae.stop()

    asyncio.run(main())
    engine.check_idle()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc (Linux)")
def test_step_thread_has_its_os_name(engine):
    """The step thread names itself, so a benchmark can tell its CPU time from the event loop's."""

    async def main() -> set[str]:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            [o async for o in ae.generate("a", [5, 6], params)]
            return {p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm")}
        finally:
            await ae.stop()

    assert "inferd-engine" in asyncio.run(main())

"""The OpenAI Agents SDK as a new user runs it, in its default mode (the Responses API), against a gateway: a
tool-calling agent for several turns, non-streamed and with ``Runner.run_streamed``, continued by
``previous_response_id`` and with ``store=False``. Run by ``tests/test_agents_sdk.py`` in a process of its own (the
SDK's defaults are process-wide); prints one JSON object of what it saw.

    python -m tests.agents_sdk_client http://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

CALLS: list[dict[str, Any]] = []


@function_tool
def read_file(path: str) -> str:
    """Read a file of the project.

    Args:
        path: the file's path.
    """
    CALLS.append({"tool": "read_file", "path": path})
    return f"{path}: 42 lines, all fine"


def kinds(result: Any) -> list[str]:
    return [item.type for item in result.new_items]


async def main(url: str) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    set_tracing_disabled(True)
    agent = Agent(name="coder", instructions="You are a coding agent. Use read_file when asked.", model="sim-model",
                  tools=[read_file], model_settings=ModelSettings(max_tokens=48))
    out: dict[str, Any] = {"turns": []}
    # turn 1, not streamed: the model calls the tool, the SDK runs it and sends its output back, the model answers
    r1 = await Runner.run(agent, "please use read_file on the readme")
    out["turns"].append({"mode": "run", "items": kinds(r1), "final": r1.final_output, "id": r1.last_response_id})
    # turn 2, streamed, the whole history resent as input items (the SDK's to_input_list)
    r2 = Runner.run_streamed(agent, [*r1.to_input_list(), {"role": "user", "content": "again, please use read_file"}])
    events = [ev.type async for ev in r2.stream_events()]
    deltas = sum(1 for ev in events if ev == "raw_response_event")
    out["turns"].append({"mode": "run_streamed", "items": kinds(r2), "final": r2.final_output,
                         "id": r2.last_response_id, "raw_events": deltas})
    # turn 3, continued on the gateway's stored conversation: only the new message is sent
    r3 = await Runner.run(agent, "once more, please use read_file", previous_response_id=r2.last_response_id)
    out["turns"].append({"mode": "previous_response_id", "items": kinds(r3), "final": r3.final_output,
                         "id": r3.last_response_id})
    # turn 4, streamed and continued
    r4 = Runner.run_streamed(agent, "and a last time, please use read_file", previous_response_id=r3.last_response_id)
    async for _ in r4.stream_events():
        pass
    out["turns"].append({"mode": "run_streamed+previous_response_id", "items": kinds(r4), "final": r4.final_output,
                         "id": r4.last_response_id})
    # turn 5: store=False, the history sent by the SDK itself
    quiet = agent.clone(model_settings=ModelSettings(max_tokens=48, store=False))
    r5 = await Runner.run(quiet, [*r4.to_input_list(), {"role": "user", "content": "please use read_file, unstored"}])
    out["turns"].append({"mode": "store=False", "items": kinds(r5), "final": r5.final_output, "id": r5.last_response_id})
    try:
        await client.responses.retrieve(r5.last_response_id or "")
        out["unstored_found"] = True
    except Exception as exc:  # the SDK's NotFoundError: what a store=False response must give
        out["unstored_found"] = type(exc).__name__
    out["calls"] = CALLS
    await client.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))

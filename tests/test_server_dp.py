"""``deepinfer serve --dp 2 --ep 2``: the same server over the multi-process engine (gloo on CPU, real
worker processes): it answers, streams, and an aborted request frees its rank's KV blocks."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

try:
    import httpx
except ImportError:
    import httpx2 as httpx

from server_helpers import metric_samples, server, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def base():
    with server("--dp", "2", "--ep", "2", "--max-num-seqs", "8") as url:
        yield url


def test_dp_ep_server_answers_streams_and_frees_aborted_requests(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    whole = client.completions.create(model="deepinfer-default", prompt="def f(x):", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="deepinfer-default", prompt="def f(x):", max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text

    async def many():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        rs = await asyncio.gather(*(c.chat.completions.create(
            model="deepinfer-default", messages=[{"role": "user", "content": f"task {i}"}], max_tokens=5,
            temperature=0, extra_body={"ignore_eos": True}) for i in range(6)))
        await c.close()
        return rs

    assert [r.usage.completion_tokens for r in asyncio.run(many())] == [5] * 6

    body = {"prompt": "while True:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert metric_samples(base)[("deepinfer:kv_cache_usage_perc", ())] > 0
    wait_for(lambda: metric_samples(base)[("deepinfer:kv_cache_usage_perc", ())] == 0, what="KV usage back to 0")
    assert metric_samples(base)[("deepinfer:num_requests_running", ())] == 0

"""What a request's images may cost the server (issue 37, point 17: ten 46 KB PNGs of 7000 x 7000 pixels, each under
the per-image cap, took the HTTP process to 4.1 GB): the pixels a request's images declare in their headers are
capped per request before anything is decoded (a 400 naming --max-request-pixels), and decoding shares a server-wide
budget of pixels at once and per second (a request that cannot start in time gets a 429)."""

import asyncio
import io
import time

import httpx
import pytest

from areno.models.multimodal import data_url
from areno.serve.errors import APIError
from areno.serve.media import PixelBudget
from areno.testing import make_tiny_checkpoint
from tests.serve.conftest import RunningServer

CAP = 1_000_000


def png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (w, h), 128).save(buf, format="PNG")  # one grey: a few KB for any size
    return buf.getvalue()


def images_message(*images: bytes) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}]


@pytest.fixture(scope="module")
def vl_capped(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("media_limits"), "qwen3_vl", seed=5)
    s = RunningServer(ckpt, max_request_pixels=CAP, max_image_pixels=2 * CAP)
    yield s
    s.stop()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_images_over_the_request_cap_get_a_400_naming_it_before_decoding(vl_capped, route):
    body = {"messages": images_message(png(800, 800), png(800, 800))}  # each under the image cap
    if route != "/tokenize":
        body |= {"model": "tiny", "max_tokens": 2}
    r = httpx.post(vl_capped.base_url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "messages" and "--max-request-pixels" in error["message"], error
    assert "1280000 pixels" in error["message"]
    # the header is what counts: a file cut after it (undecodable) is refused the same way, nothing decoded
    cut = png(800, 800)[:60]
    body["messages"] = images_message(cut, cut)
    r = httpx.post(vl_capped.base_url + route, json=body, timeout=60)
    assert r.status_code == 400 and "--max-request-pixels" in r.json()["error"]["message"], r.text[:300]


def test_images_under_the_cap_are_served(vl_capped):
    r = httpx.post(vl_capped.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": images_message(png(64, 48), png(32, 32)), "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]


def test_pixel_budget_bounds_pixels_at_once_and_per_second():
    async def main():
        budget = PixelBudget(in_flight=1000, per_second=1500, max_wait_s=0.3)
        async with budget.hold(800):
            t = time.monotonic()
            with pytest.raises(APIError) as refused:  # 800 + 300 at once is over 1000: waits, then 429
                async with budget.hold(300):
                    pass
            assert time.monotonic() - t >= 0.25
        assert refused.value.status == 429 and "--max-request-pixels" in refused.value.message
        assert budget.used == 0
        rate = PixelBudget(in_flight=1000, per_second=1000, max_wait_s=5)
        async with rate.hold(1000):  # a second's worth at once
            pass
        t = time.monotonic()
        async with rate.hold(500):  # waits ~0.5 s for the bucket to refill
            waited = time.monotonic() - t
        assert 0.3 < waited < 2, waited

    asyncio.run(main())


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def test_the_issues_ten_7000_pixel_pngs_are_refused_from_their_headers(vl_capped):
    """The issue's request (ten small PNGs of 7000 x 7000 pixels, 490M pixels once decoded) is refused within a
    second, and the server (in this process) grows by a few MB, not the gigabytes a decode takes."""
    big = png(7000, 7000)
    assert len(big) < 200_000
    body = {"model": "tiny", "max_tokens": 2, "messages": images_message(*[big] * 10)}
    before = rss()
    t = time.perf_counter()
    r = httpx.post(vl_capped.base_url + "/v1/chat/completions", json=body, timeout=60)
    took = time.perf_counter() - t
    assert r.status_code == 400 and "490000000 pixels" in r.json()["error"]["message"], r.text[:300]
    assert took < 5 and rss() - before < 200 << 20, (took, (rss() - before) >> 20)

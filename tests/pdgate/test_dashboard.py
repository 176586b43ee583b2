"""The live dashboard on the admin plane, in a real headless Chromium (Debian's chromium and chromium-driver,
driven by selenium): the page loads, a live request appears with its phase and deadline, its waterfall draws
the attempt's legs and events, it finishes and leaves the live table, a deadline expiry shows under recent
failures; a screenshot is saved. And the page and its snapshot behind an admin key, over plain HTTP."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdgate.core.config import AdminKey, hash_key
from tests.pdgate.harness import Running, make_config, start_gateway
from tests.procs import Procs

CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
KEY = "pdgate-admin-test-key-0123456789"


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM or ""
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def wait_for(driver: Any, check: Any, within: float = 15.0) -> Any:
    end = time.monotonic() + within
    while True:
        got = check(driver)
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"not seen within {within}s; page: {driver.find_element('tag name', 'body').text[:3000]}")
        time.sleep(0.1)


async def stream(http: aiohttp.ClientSession, g: Running, ids: list[str], **headers: str) -> int:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 80,
            "stream": True}
    async with http.post(g.url + "/v1/chat/completions", json=body, headers=headers) as r:
        ids.append(r.headers.get("x-request-id", ""))
        await r.read()
        return r.status


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium not installed (apt-get install chromium chromium-driver)")
async def test_dashboard_in_a_real_browser(procs: Procs, gateways: list[Any], tmp_path: Path) -> None:
    p, d = procs.sim("prefill"), procs.sim("decode", "--speed", "10")  # 40 ms per decode step: streams of ~3 s
    g = await start_gateway(make_config([p], [d]))
    gateways.append(g)
    driver = await asyncio.to_thread(browser)
    try:
        await asyncio.to_thread(driver.get, g.admin + "/dashboard")
        await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_element("id", "instance").text == g.gw.instance)
        workers = await asyncio.to_thread(lambda: driver.find_element("id", "workers").text)
        assert "p0" in workers and "d0" in workers and "up" in workers, workers
        async with aiohttp.ClientSession() as http:
            ids: list[str] = []
            live = asyncio.create_task(stream(http, g, ids))
            late = asyncio.create_task(stream(http, g, [], **{"x-pdgate-timeout": "0.5"}))
            while not ids:
                await asyncio.sleep(0.02)
            rid = ids[0]
            row = f'#live tr[data-id="{rid}"]'
            el = await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_elements("css selector", row))
            text = await asyncio.to_thread(lambda: el[0].text)
            assert "decode" in text and any(k in text for k in ("idle", "total", "ttft")), text  # phase, next deadline
            await asyncio.to_thread(lambda: driver.find_element("css selector", row).click())
            await asyncio.to_thread(wait_for, driver, lambda dr: "attempt 1 decode d0" in
                                    dr.find_element("id", "waterfall").get_attribute("innerHTML"))
            info = await asyncio.to_thread(lambda: driver.find_element("id", "wfinfo").text)
            assert "(live)" in info and "engines:" in info, info  # and where the engines hold it
            shot = tmp_path / "dashboard-live.png"
            await asyncio.to_thread(driver.save_screenshot, str(shot))
            if os.environ.get("PDGATE_DASHBOARD_SHOT"):  # how docs/dashboard.png is made
                shutil.copy(shot, os.environ["PDGATE_DASHBOARD_SHOT"])
            assert await live == 200 and await late == 200
            await asyncio.to_thread(wait_for, driver, lambda dr: not dr.find_elements("css selector", row))
            await asyncio.to_thread(wait_for, driver, lambda dr: "(completed, 200)" in dr.find_element("id", "wfinfo").text)
            svg = await asyncio.to_thread(lambda: driver.find_element("id", "waterfall").get_attribute("innerHTML"))
            for part in ("first_token", "decode_done", "attempt 1 prefill p0", "completed"):
                assert part in svg, part
            recent = await asyncio.to_thread(wait_for, driver, lambda dr: "deadline_exceeded" in
                                             dr.find_element("id", "recent").text and dr.find_element("id", "recent").text)
            assert "deadline_exceeded" in recent
            # completed requests per second over the page's refreshes: a small line once two rates are in
            line = await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_elements(
                "css selector", "#goodspark svg polyline"))
            assert line and "completed requests per second" in line[0].find_element("xpath", "..").get_attribute(
                "aria-label")
            # a session's rounds: a Responses chain of two, listed under its first response
            async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "hi",
                                                                "max_output_tokens": 2}) as r:
                first = (await r.json())["id"]
            async with http.post(g.url + "/v1/responses", json={"model": "sim-model", "input": "more",
                                                                "previous_response_id": first,
                                                                "max_output_tokens": 2}) as r:
                second = (await r.json())["id"]
            sessions = await asyncio.to_thread(wait_for, driver, lambda dr: second.removeprefix("resp_") in
                                               dr.find_element("id", "sessions").text
                                               and dr.find_element("id", "sessions").text)
            assert first in sessions and first.removeprefix("resp_") in sessions and "completed" in sessions
        await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "dashboard.png"))
        assert shot.stat().st_size > 20_000 and (tmp_path / "dashboard.png").stat().st_size > 20_000
        # at 1280 px nothing scrolls sideways, and no two of the waterfall's event labels print over each other
        await asyncio.to_thread(driver.set_window_size, 1280, 900)
        await asyncio.sleep(1.2)  # a refresh at that width
        wide = await asyncio.to_thread(driver.execute_script, """
            const over = [...document.querySelectorAll("table")].filter((t) => t.scrollWidth > t.parentElement.clientWidth + 1)
              .map((t) => t.id);
            const boxes = [...document.querySelectorAll("#waterfall text.ev")].map((t) => t.getBBox());
            const overlaps = boxes.flatMap((a, i) => boxes.slice(i + 1).filter((b) => a.x < b.x + b.width && b.x < a.x + a.width
              && a.y < b.y + b.height && b.y < a.y + a.height)).length;
            return {page: document.documentElement.scrollWidth - window.innerWidth, over, overlaps, labels: boxes.length};""")
        assert wide["page"] <= 0 and wide["over"] == [] and wide["overlaps"] == 0 and wide["labels"] >= 3, wide
        await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "dashboard-1280.png"))
    finally:
        await asyncio.to_thread(driver.quit)


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="chromium not installed (apt-get install chromium chromium-driver)")
async def test_dashboard_with_an_admin_key_in_the_browser(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d], admin_keys=(AdminKey("ops", hash_key(KEY)),)))
    gateways.append(g)
    driver = await asyncio.to_thread(browser)
    try:
        await asyncio.to_thread(driver.get, g.admin + "/dashboard")  # no key: the page asks for one
        await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_element("id", "key").is_displayed())
        assert "admin key is needed" in await asyncio.to_thread(lambda: driver.find_element("id", "err").text)

        def give_key() -> None:
            driver.find_element("id", "keyin").send_keys(KEY)
            driver.find_element("id", "keygo").click()

        await asyncio.to_thread(give_key)
        await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_element("id", "instance").text == g.gw.instance)
        stored = await asyncio.to_thread(driver.execute_script, "return [sessionStorage.getItem('pdgate-admin-key'), "
                                                                "localStorage.length]")
        assert stored == [KEY, 0], "kept in this tab only"
        # a key in a URL (which the browser's history would keep) is not taken: a fresh tab still asks for one
        await asyncio.to_thread(driver.switch_to.new_window, "tab")
        await asyncio.to_thread(driver.get, g.admin + f"/dashboard#key={KEY}")
        await asyncio.to_thread(wait_for, driver, lambda dr: dr.find_element("id", "key").is_displayed())
    finally:
        await asyncio.to_thread(driver.quit)


async def test_dashboard_page_is_open_its_data_is_not(procs: Procs, gateways: list[Any]) -> None:
    p, d = procs.pair()
    g = await start_gateway(make_config([p], [d], admin_keys=(AdminKey("ops", hash_key(KEY)),)))
    gateways.append(g)
    async with aiohttp.ClientSession() as http:
        async with http.get(g.admin + "/dashboard") as r:
            assert r.status == 200 and r.content_type == "text/html"
            assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
            assert "/v1/dashboard" in await r.text()
        async with http.get(g.admin + "/v1/dashboard") as r:
            assert r.status == 401
        async with http.get(g.admin + "/v1/dashboard", headers={"Authorization": f"Bearer {KEY}"}) as r:
            snap = await r.json()
            assert r.status == 200 and [w["id"] for w in snap["workers"]] == ["p0", "d0"] and snap["live"] == []
        for path in ("/dashboard", "/v1/dashboard"):  # not on the front door
            async with http.get(g.url + path) as r:
                assert r.status == 401, path

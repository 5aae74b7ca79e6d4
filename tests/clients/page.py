"""The page in headless Chromium (Playwright, Debian's chromium): the playground
streams text into the page, the dashboard draws a loss curve that grows while
`tinygpt train` writes metrics.jsonl (the table's step count with it), each tab has its URL (/#runs opens the runs,
a reload keeps the tab), the header fits a 400 px wide window, no console errors;
screenshots saved.

    python tests/clients/page.py http://127.0.0.1:PORT SCREENSHOT_DIR
"""
import json
import os
import re
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright

base, shots = sys.argv[1], sys.argv[2]
os.makedirs(shots, exist_ok=True)
errors = []


def visible_tab(page):
    """The tab whose panel shows, checked against the highlighted tab (both read in one
    script: a hashchange handled between two reads would pair one tab's panel with the
    other's highlight)."""
    shown, active = page.evaluate("""[
        [...document.querySelectorAll('.panel')].filter((p) => p.offsetParent !== null).map((p) => p.dataset.tab),
        [...document.querySelectorAll('.tab.active')].map((t) => t.dataset.tab),
    ]""")
    assert len(shown) == 1 and shown == active, (shown, active)
    return shown[0]


def click_tab(page, name):
    """Clicks a tab and waits for its panel: the URL's hash changes at once, the page
    switches panels in the hashchange event that follows."""
    page.click(f".tab[data-tab={name}]")
    assert page.evaluate("location.hash") == "#" + name, page.evaluate("location.hash")
    page.wait_for_function(f"document.querySelector('.panel.active').dataset.tab === '{name}'", timeout=5000)


with sync_playwright() as p:
    browser = p.chromium.launch(
        executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )
    page = browser.new_page(viewport={"width": 1366, "height": 800})
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('parameters')")

    # Playground: the text streams in, token by token, then the stats line.
    page.fill("#prompt", "To be")
    page.fill("#max-tokens", "300")
    page.fill("#seed", "4")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#output span:nth-child(2)').textContent.length > 0")
    partial = len(page.inner_text("#output"))
    page.wait_for_function("document.getElementById('stats').textContent.includes('first token')", timeout=60000)
    final = page.inner_text("#output")
    assert final.startswith("To be") and len(final) >= partial, (partial, final)
    stats = page.inner_text("#stats")
    assert "length" in stats, stats
    # "N tokens in T s · first token F ms · R tokens/s": R is either N - 1 tokens over a
    # span of 50 ms or more, or N over the whole T (shown to 0.01 s), so it is at most the
    # larger of N / 0.05 and N / (T - 0.005). A rate timed over reads that came in
    # together (N over a millisecond) is far above both.
    found = re.search(r"(\d+) tokens in ([\d.]+) s .* (\d+) tokens/s", stats)
    assert found, stats
    n, total, rate = int(found[1]), float(found[2]), int(found[3])
    assert rate <= max(n / 0.05, n / max(total - 0.005, 1e-3)) + 1, stats
    page.screenshot(path=os.path.join(shots, "playground.png"), full_page=True)

    # A seed past 2^53 goes as its digits: the page's text is the API's for that seed
    # (sent as a JavaScript number it was 2^53's), and 2^64 - 1 is taken.
    for seed in ["9007199254740993", "18446744073709551615"]:
        page.fill("#seed", seed)
        page.fill("#max-tokens", "40")
        page.click("#generate")
        page.wait_for_function("document.getElementById('stats').textContent.includes('first token')", timeout=60000)
        shown = page.inner_text("#output")
        request = urllib.request.Request(
            base + "/v1/completions",
            data=('{"prompt": "To be", "max_tokens": 40, "temperature": 0.8, "top_p": 1, "top_k": 0, "seed": %s}' % seed).encode(),
            headers={"Content-Type": "application/json"},
        )
        expected = json.load(urllib.request.urlopen(request))["choices"][0]["text"]
        assert shown == "To be" + expected, (seed, shown, expected)
        assert page.locator("#play-error").is_hidden(), page.inner_text("#play-error")

    # Runs: the table lists the runs, the loss chart has points and grows as the
    # training run in the other process logs more.
    click_tab(page, "runs")
    page.wait_for_selector("#runs-table tbody tr")
    page.wait_for_function("Number(document.getElementById('chart-loss').dataset.points || 0) > 0")
    before = int(page.get_attribute("#chart-loss", "data-points"))
    deadline = time.time() + 60
    while int(page.get_attribute("#chart-loss", "data-points")) <= before:
        assert time.time() < deadline, "the loss curve did not grow"
        time.sleep(0.2)
    after = int(page.get_attribute("#chart-loss", "data-points"))
    assert page.locator("#chart-loss canvas").count() == 1
    # The table's step count keeps up with the curve: both move on each poll of the
    # metrics, not the table only when the list of runs is fetched again (every 5 s).
    # Read together in one script, for three seconds while the run trains.
    for _ in range(15):
        table, chart = page.evaluate("""[
            Math.max(...[...document.querySelectorAll('#runs-table tbody td:nth-child(4)')].map((td) => Number(td.textContent))),
            Number(document.getElementById('chart-loss').dataset.lastStep),
        ]""")
        assert table >= chart, f"the table says {table} steps while the loss curve reaches step {chart}"
        time.sleep(0.2)
    page.screenshot(path=os.path.join(shots, "runs.png"), full_page=True)

    # A sample from a run's checkpoint.
    page.fill("#sample-prompt", "To")
    page.click("#sample-go")
    page.wait_for_function("document.getElementById('sample-text').textContent.length > 10 && !document.getElementById('sample-text').textContent.startsWith('sampling')", timeout=60000)

    # A reload keeps the tab; Playground's tab has its URL too.
    page.reload()
    page.wait_for_selector("#runs-table tbody tr")
    assert visible_tab(page) == "runs", visible_tab(page)
    click_tab(page, "playground")
    assert visible_tab(page) == "playground", visible_tab(page)

    # A shared link to the runs, opened in a phone-sized window: the runs tab shows,
    # and the header (and the page) fit 400 px without scrolling sideways.
    narrow = browser.new_page(viewport={"width": 400, "height": 800})
    narrow.on("console", lambda m: m.type == "error" and errors.append(m.text))
    narrow.on("pageerror", lambda e: errors.append(str(e)))
    narrow.goto(base + "/#runs")
    narrow.wait_for_selector("#runs-table tbody tr")
    narrow.wait_for_function("document.getElementById('model').textContent.includes('parameters')")
    assert visible_tab(narrow) == "runs", visible_tab(narrow)
    assert narrow.evaluate("window.scrollY") == 0, "following #runs scrolled the page"
    def header_fits(case):
        header = narrow.evaluate("(() => { const h = document.querySelector('header'); return [h.scrollWidth, h.clientWidth]; })()")
        assert header[0] <= header[1], f"the header overflows at 400 px ({case}): scrollWidth {header[0]} > clientWidth {header[1]}"
        for item in narrow.evaluate("[...document.querySelectorAll('header > *:not([hidden])')].map((e) => e.getBoundingClientRect().right)"):
            assert item <= 400, f"a header item ends at {item} px, past 400 ({case})"
    header_fits("as served")
    # The widest header the page makes: the API key field shown (a server with
    # --api-key) beside a long run name.
    narrow.evaluate("document.getElementById('api-key').hidden = false")
    narrow.evaluate("document.getElementById('model').textContent = 'shakespeare-bpe-n_layer-4-n_embd-256-block_size-256 · 3.21M parameters · context 256 · 8 slots'")
    header_fits("with the key field and a long run name")
    narrow.screenshot(path=os.path.join(shots, "header-400px.png"))
    narrow.reload()
    narrow.wait_for_selector("#runs-table tbody tr")
    width = narrow.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert width[0] <= width[1], f"the runs tab scrolls sideways at 400 px: {width}"
    # What differs between the runs wraps between words (after `_` or `=`), never
    # inside one: each piece between break points lies on one line.
    split = narrow.evaluate("""[...document.querySelectorAll('#runs-table .setting')].flatMap((s) =>
        [...s.childNodes].filter((n) => n.nodeType === Node.TEXT_NODE).map((n) => {
            const r = document.createRange(); r.selectNodeContents(n);
            return [n.textContent, r.getClientRects().length];
        })).filter(([, lines]) => lines > 1)""")
    assert narrow.locator("#runs-table .setting").count() > 0, "no differing settings listed"
    assert not split, f"settings broken mid-word at 400 px: {split}"
    narrow.screenshot(path=os.path.join(shots, "runs-400px.png"), full_page=True)
    narrow.goto(base + "/")
    narrow.wait_for_function("document.getElementById('model').textContent.includes('parameters')")
    assert visible_tab(narrow) == "playground", visible_tab(narrow)
    width = narrow.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert width[0] <= width[1], f"the playground scrolls sideways at 400 px: {width}"
    narrow.screenshot(path=os.path.join(shots, "playground-400px.png"), full_page=True)
    browser.close()

assert not errors, errors
print(f"page: playground streamed {len(final)} characters; loss curve grew {before} -> {after} points; tabs have URLs; the header fits 400 px; no console errors; screenshots in {shots}")

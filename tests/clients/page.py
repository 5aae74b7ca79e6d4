"""The page in headless Chromium (Playwright, Debian's chromium): the playground
streams text into the page, the dashboard draws a loss curve that grows while
`tinygpt train` writes metrics.jsonl, no console errors; screenshots saved.

    python tests/clients/page.py http://127.0.0.1:PORT SCREENSHOT_DIR
"""
import os
import sys
import time

from playwright.sync_api import sync_playwright

base, shots = sys.argv[1], sys.argv[2]
os.makedirs(shots, exist_ok=True)
errors = []

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
    assert "length" in page.inner_text("#stats"), page.inner_text("#stats")
    page.screenshot(path=os.path.join(shots, "playground.png"), full_page=True)

    # Runs: the table lists the runs, the loss chart has points and grows as the
    # training run in the other process logs more.
    page.click("button[data-tab=runs]")
    page.wait_for_selector("#runs-table tbody tr")
    page.wait_for_function("Number(document.getElementById('chart-loss').dataset.points || 0) > 0")
    before = int(page.get_attribute("#chart-loss", "data-points"))
    deadline = time.time() + 60
    while int(page.get_attribute("#chart-loss", "data-points")) <= before:
        assert time.time() < deadline, "the loss curve did not grow"
        time.sleep(0.2)
    after = int(page.get_attribute("#chart-loss", "data-points"))
    assert page.locator("#chart-loss canvas").count() == 1
    page.screenshot(path=os.path.join(shots, "runs.png"), full_page=True)

    # A sample from a run's checkpoint.
    page.fill("#sample-prompt", "To")
    page.click("#sample-go")
    page.wait_for_function("document.getElementById('sample-text').textContent.length > 10 && !document.getElementById('sample-text').textContent.startsWith('sampling')", timeout=60000)
    browser.close()

assert not errors, errors
print(f"page: playground streamed {len(final)} characters; loss curve grew {before} -> {after} points; no console errors; screenshots in {shots}")

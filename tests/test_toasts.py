"""Toasts (app.extensionManager.toast.add) in headless Chromium against a real server: for errors
the pack raises in a prompt, with the prompt's own message, and for the panel's refused requests.

A prompt's execution_error reaches the page that queued it: the tests queue with the page's
client id, as its Queue button does. An error the pack did not raise gets no toast of the pack.
"""
from __future__ import annotations

import re

import pytest

from test_panel import CHROMIUM, PanelPage, browser, sync_api, tiered_workflow  # noqa: F401  (browser is a fixture)
from workflows import sample_workflow

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")

NOT_A_MODEL = "tiered_toasts_not_a_model.safetensors"
OURS = "Tiered Offload:"   # every prompt-error toast of the pack starts so (locales/en/main.json)


@pytest.fixture(scope="module")
def page(comfy, browser):  # noqa: F811
    p = PanelPage(browser, comfy.url)
    p.load()
    if not p.page.evaluate("typeof app.extensionManager.toast?.add === 'function'"):
        p.page.close()
        pytest.skip("this frontend has no toast.add")
    p.page.evaluate("""async () => { const { api } = await import('/scripts/api.js');
        window.__errors = 0; api.addEventListener('execution_error', () => window.__errors++); }""")
    yield p
    p.page.close()


def run_failing(comfy, page, workflow: dict) -> dict:
    """Queue as the page's own client, wait until the page has heard the error; return it as
    /history has it."""
    heard = page.page.evaluate("window.__errors")
    client = page.page.evaluate("""async () => { const { api } = await import('/scripts/api.js');
        return api.clientId ?? api.initialClientId; }""")
    entry = comfy.wait(comfy.queue(workflow, client_id=client))
    assert entry["status"]["status_str"] == "error", entry["status"]
    page.page.wait_for_function("(n) => window.__errors > n", arg=heard)
    page.page.keyboard.press("Escape")   # the frontend's own error report (a dialog in 1.32)
    return next(data for kind, data in entry["status"]["messages"] if kind == "execution_error")


def pack_toasts(page):
    return page.page.locator(".p-toast-message").filter(has_text=OURS)


def flat(text: str) -> str:
    return " ".join(text.split())


def close_toasts(page) -> None:
    page.page.evaluate("() => app.extensionManager.toast.removeAll?.()")
    sync_api.expect(page.page.locator(".p-toast-message")).to_have_count(0)


def test_a_refusal_in_a_pack_node_toasts_the_prompts_message(comfy, page):
    """A refusal raised by Apply Layerwise Offload itself when it runs (a host cache out of range
    through a link: a widget's value would be refused at queue time, with no prompt to fail)."""
    close_toasts(page)
    wf = sample_workflow("wan21", layerwise={"host_cache_gb": ["cache", 0]}, seed=301)
    wf["cache"] = {"class_type": "PrimitiveFloat", "inputs": {"value": 1e18}}
    error = run_failing(comfy, page, wf)
    assert error["node_type"] == "ApplyLayerwiseOffload", error
    toast = pack_toasts(page)
    sync_api.expect(toast).to_have_count(1)
    text = flat(toast.inner_text())
    assert "Apply Layerwise Offload" in text.split(OURS, 1)[1], text   # the node's title
    assert flat(error["exception_message"]) in text, (error["exception_message"], text)


def test_a_refusal_the_pack_raises_inside_a_core_node_toasts_too(comfy, page):
    """host_cache_gb far below one streamed unit: the engine refuses while KSampler runs, so the
    failed node is core's; the traceback's last frame is in the pack."""
    close_toasts(page)
    wf = sample_workflow("wan21", layerwise={"host_cache_gb": 1e-6, "resident_blocks": 0}, seed=302)
    error = run_failing(comfy, page, wf)
    assert error["node_type"] == "KSampler" and "host_cache_gb" in error["exception_message"], error
    toast = pack_toasts(page)
    sync_api.expect(toast).to_have_count(1)
    assert flat(error["exception_message"]) in flat(toast.inner_text())


def test_an_error_the_pack_did_not_raise_gets_no_toast_of_the_pack(comfy, page):
    """Core's UNETLoader fails on a file that is no model: the frontend reports it; the pack
    stays quiet."""
    path = comfy.base / "models" / "diffusion_models" / NOT_A_MODEL
    path.write_bytes(b"not a safetensors file")
    try:
        close_toasts(page)
        wf = sample_workflow("wan21", seed=303)
        wf["load"]["inputs"]["unet_name"] = NOT_A_MODEL
        error = run_failing(comfy, page, wf)
        assert error["node_type"] == "UNETLoader", error
        page.page.wait_for_timeout(500)   # a toast would be added in the same event handler
        assert pack_toasts(page).count() == 0
    finally:
        path.unlink()


def test_a_refused_budgets_save_toasts_and_says_so_in_the_form(comfy, page):
    """The panel's budgets POST while a prompt runs: 409, shown in the form and as a toast."""
    close_toasts(page)
    page.open_tab()
    prompt_id = comfy.queue_running(tiered_workflow(seed=304, steps=10_000))
    try:
        panel = page.page.locator("#tiered-offload-panel")
        panel.locator('[data-role="edit-budgets"]').click()
        form = panel.locator('[data-role="budget-form"]')
        form.locator('input[name="ram_reserve_gb"]').fill("1.5")
        form.locator('[data-role="save-budgets"]').click()
        sync_api.expect(form.locator('[data-role="budget-error"]')).to_contain_text("409")
        assert comfy.get("/queue")["queue_running"], "the prompt ended before the save: not a refusal test"
        toast = page.page.locator(".p-toast-message").filter(has_text="Budgets refused")
        sync_api.expect(toast).to_have_count(1)
        assert re.search(r"prompt is running.*409", flat(toast.inner_text())), toast.inner_text()
        form.locator('[data-role="cancel-budgets"]').click()
    finally:
        comfy.interrupt()
        comfy.wait(prompt_id, timeout=120)
    assert comfy.get("/api/offload/tiers")["budgets"]["ram_reserve_bytes"] == 2 * 2**30

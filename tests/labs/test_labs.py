"""`inferd lab`: every lab runs in --quick mode (once per session, through the CLI) and leaves JSON, a plot and
text with its measured numbers; every claim is true of its own numbers, `must` claims hold as the textbook
says, and the checker that guarantees this does catch a false sentence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from inferd.cli import main
from inferd.labs import LAB_MODULES, all_labs, find_lab
from inferd.labs.base import Measurement
from inferd.labs.context import machine_line
from inferd.labs.runner import LabResult, check_result, write_glossary_page
from inferd.models.tiny import tiny_model

pytestmark = pytest.mark.timeout(900)

LAB_NAMES = [lab.name for lab in all_labs()]
PRICE = 2.5


def _result(lab_run, name: str) -> LabResult:
    return LabResult.from_dict(json.loads((lab_run["out"] / f"{name}.json").read_text()))


def test_all_labs_ran_without_a_false_claim(lab_run):
    assert lab_run["rc"] == 0, lab_run["stderr"][-3000:]


@pytest.mark.parametrize("name", LAB_NAMES)
def test_each_lab_writes_json_plot_and_text_with_its_numbers(lab_run, name):
    result = _result(lab_run, name)
    assert result.lab == name and result.quick and result.machine["cpu_count"] >= 1 and result.date
    png = lab_run["out"] / result.plot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert result.text in lab_run["stdout"]  # printed as written
    assert result.claims, "a lab must claim something about its numbers"
    assert all(isinstance(v, int | float) and not math.isnan(v) for v in result.numbers.values())
    assert check_result(result) == []  # every claim true of its numbers, and its numbers in its sentence
    for claim in result.claims:
        if claim.must:
            assert claim.agrees is True, claim.text


def test_the_textbook_invariants_are_claimed(lab_run):
    """The textbook checks each lab names, on the numbers themselves."""
    paged = _result(lab_run, "paged-attention").numbers
    assert paged["paged_concurrency"] > paged["contiguous_concurrency"]
    good = _result(lab_run, "goodput")
    assert all(g <= t for g, t in zip(good.series["goodput"], good.series["tok_s"], strict=True))
    dec = _result(lab_run, "decode").numbers
    assert dec["step_ms_bmax"] < dec["b_max"] * dec["step_ms_b1"]  # sub-linear in batch
    kv = _result(lab_run, "kv-cache").numbers
    assert kv["allocator_bytes_per_token"] == kv["formula_bytes_per_token"]
    gw = _result(lab_run, "envoy-ai-gateway").numbers
    assert gw["admitted"] == 3 and gw["refused_status"] == 429 and gw["exact_fit_ok"] == 1


def test_report_has_every_term_and_ends_with_cost(lab_run):
    report = (lab_run["out"] / "report.md").read_text()
    for lab in all_labs():
        assert f"## {lab.term}" in report and f"]({lab.name}.png)" in report
    contradicted = [c.text for name in LAB_NAMES for c in _result(lab_run, name).claims if c.agrees is False]
    assert all(text in report.split("## Prefill", 1)[0] for text in contradicted)  # gathered up front
    tail = report.split("## Cost per million tokens", 1)[1]  # the capstone: the last section
    cost = _result(lab_run, "cost").numbers
    assert f"${PRICE:.2f} an hour" in tail and "\n## " not in tail
    assert cost["price_per_hour"] == PRICE and cost["cost_goodput"] >= cost["cost_throughput"] > 0


def test_the_checker_catches_a_false_or_numberless_sentence(lab_run):
    result = _result(lab_run, "paged-attention")
    claim = next(c for c in result.claims if c.left == "paged_concurrency")
    lying = LabResult.from_dict(result.to_dict())
    lying.numbers["paged_concurrency"] = 0  # the sentence now says more than the numbers
    assert any("false claim" in p for p in check_result(lying))
    vague = LabResult.from_dict(result.to_dict())
    shown = claim.shown_numbers(result.numbers)[0]
    for c in vague.claims:
        c.text = c.text.replace(shown, "many")
    assert any("does not show" in p for p in check_result(vague))


def _decode_numbers(bw_pct: float, overhead_ms: float) -> Measurement:
    n = dict(
        b_max=16, step_ms_b1=10.0, step_ms_bmax=14.0, step_ms_b1_times_bmax=160.0, tok_s_b1=100.0, tok_s_bmax=1143.0,
        mb_read_b1=1000.0, gb_s_b1=bw_pct / 2, bandwidth_gb_s=50.0, bw_pct_b1=bw_pct, t_mem_ms_b1=20.0 * bw_pct / 100,
        t_flops_ms_b1=0.5, overhead_ms_b1=overhead_ms, peak_tflops=1.0,
    )  # fmt: skip
    return Measurement(numbers=n, settings={"batches": [1, 16], "prompt_len": 32, "output_len": 8})


def test_decode_says_so_when_this_machine_contradicts_the_glossary():
    decode = find_lab("decode")
    textbook = decode.explain(_decode_numbers(bw_pct=90.0, overhead_ms=0.5))
    claim = next(c for c in textbook.claims if c.left == "bw_pct_b1")
    assert claim.agrees is True and "memory-bandwidth-bound, as the glossary says" in claim.text
    cpu = decode.explain(_decode_numbers(bw_pct=4.2, overhead_ms=9.0))
    claim = next(c for c in cpu.claims if c.left == "bw_pct_b1")
    assert claim.agrees is False and "not memory-bandwidth-bound here" in claim.text and "4.20%" in claim.text
    why = next(c for c in cpu.claims if c.left == "overhead_ms_b1")
    assert "fixed per-step costs" in why.text and why.holds(_decode_numbers(4.2, 9.0).numbers)


def test_a_busy_machine_is_named_in_the_text():
    from inferd.labs.runner import busy_caveat

    assert busy_caveat({"load_average_at_start": [1.5, 1, 1], "cpu_count": 2}) is None
    caveat = busy_caveat({"load_average_at_start": [11.2, 9, 8], "cpu_count": 2})
    assert "busy" in caveat and "11.2 on 2 cores" in caveat


def test_glossary_page_names_machine_and_date(lab_run, tmp_path):
    result = _result(lab_run, "kv-cache")
    page = write_glossary_page(result, tmp_path).read_text()
    assert page.startswith("# KV cache") and result.date in page and machine_line(result.machine) in page
    assert result.claims[0].text in page


def test_list_and_unknown_lab(capsys):
    assert main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(lab.name in listed for lab in all_labs()) and len(listed.splitlines()) == len(LAB_MODULES)
    assert main(["lab", "no-such-term", "--quick"]) == 2
    assert "prefill" in capsys.readouterr().err
    assert find_lab("KV cache").name == "kv-cache" and find_lab("kv_cache").name == "kv-cache"


def test_bad_price_and_quick_docs_are_refused(capsys):
    assert main(["lab", "cost", "--quick", "--price-per-hour", "-1"]) == 2
    assert "price-per-hour" in capsys.readouterr().err
    assert main(["lab", "decode", "--quick", "--write-docs"]) == 2  # a tiny model's numbers are no glossary page
    assert "drop --quick" in capsys.readouterr().err


def test_tiny_model_is_reused(tmp_path):
    first = tiny_model(tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert tiny_model(tmp_path) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert Path(first).name.startswith("tiny-llama")


def test_lab_all_goes_on_past_a_lab_that_cannot_run(tmp_path, monkeypatch, capsys):
    """A lab that needs a package the reader lacks (jsonschema, ray) is reported; the other labs still run."""
    import dataclasses

    import inferd.labs as labs
    from inferd.errors import InferdError

    def needs_a_package(ctx):
        raise InferdError("this lab needs somepackage: pip install somepackage")

    kv = labs.find_lab("kv-cache")
    broken = dataclasses.replace(kv, name="broken", measure=needs_a_package)
    monkeypatch.setattr(labs, "all_labs", lambda: [broken, kv])
    model = tiny_model(tmp_path)
    argv = ["lab", "all", "--quick", "--model", str(model), "--report", str(tmp_path / "r"), "--price-per-hour", "1"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1
    assert "lab broken did not run: this lab needs somepackage" in err
    assert (tmp_path / "r" / "kv-cache.json").exists() and (tmp_path / "r" / "report.md").exists()

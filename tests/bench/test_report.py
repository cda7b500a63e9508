"""README's speed table shows each kind of CPU the project runs on by its newest runs: a Zen 5 by its own
results once they exist, by the `avx512-bf16` runs (a Zen 5 measured before its family was read) until then."""

import copy

from benchmarks import report


def _runs():
    data = report.kinds_of("vs_peers")
    assert report.current_peer_runs(data["avx512-bf16"], report.README_LEVELS), "a comparable avx512-bf16 run"
    return data


def _dated(run: dict, date: str) -> dict:
    out = copy.deepcopy(run)
    out["date"] = date
    return out


def test_stand_in_shown_until_its_kind_has_a_newer_run():
    data = _runs()
    stand_in = report.current_peer_runs(data["avx512-bf16"], report.README_LEVELS)[-1][0]
    # the committed zen5 record is an older probe's: the stand-in's newer run is the one shown
    assert report.readme_kinds(data)[0] == "avx512-bf16"
    data["zen5"] = [*data.get("zen5", []), _dated(stand_in, "2099-01-01 00:00 UTC")]
    assert report.readme_kinds(data)[0] == "zen5"
    data["avx512-bf16"] = [_dated(stand_in, "2099-02-01 00:00 UTC")]
    assert report.readme_kinds(data)[0] == "avx512-bf16"


def test_every_kind_of_today_with_a_comparable_run_is_shown_once():
    data = _runs()
    shown = report.readme_kinds(data)
    assert len(shown) == len(set(shown)) == len(report.README_KINDS)
    assert {"xeon-amx", "zen3"} <= set(shown)
    del data["zen3"]
    assert "zen3" not in report.readme_kinds(data)
    text = report.render_how_fast()
    for kind in shown:
        assert f"`{kind}`" in text


def test_a_run_that_reused_its_prompts_from_the_prefix_cache_shows_its_first_round():
    rounds = [400.0, 520.0, 540.0]
    assert report.cold({"workload": {}}, rounds) == (400.0, True)
    reset = {"workload": {"prefix_cache": report.PREFIX_CACHE_RESET}}
    assert report.cold(reset, rounds) == (520.0, False)
    assert report.cold({"workload": {}}, [400.0]) == (400.0, False)
    assert report.cold({}, []) == (None, False)

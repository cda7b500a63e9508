"""README's speed table shows each kind of CPU the project runs on by its newest runs: a Zen 5 by its own
results once they exist, by the `avx512-bf16` runs (the Zen 4s measured here) until then, each kind's levels
in order of concurrency and its AMD core named. Offline figures of a run that repeated its prompts on a warm
prefix cache are shown by its first round."""

import copy

from benchmarks import report


def _template() -> dict:
    """A committed run that set inferd beside a peer, whatever its kind: the tests date copies of it."""
    for runs in report.kinds_of("vs_peers").values():
        current = report.current_peer_runs(runs, report.README_LEVELS)
        if current:
            return current[-1][0]
    raise AssertionError("no committed vs_peers run sets inferd beside a peer")


def _dated(date: str) -> dict:
    out = copy.deepcopy(_template())
    out["date"] = date
    return out


def test_stand_in_shown_until_its_kind_has_a_newer_run():
    data = {"zen5": [_dated("2026-11")], "avx512-bf16": [_dated("2026-12-04 15:01 UTC")]}
    assert report.readme_kinds(data) == ["avx512-bf16"]
    data["zen5"].append(_dated("2099-01-01 00:00 UTC"))
    assert report.readme_kinds(data) == ["zen5"]
    data["avx512-bf16"] = [_dated("2099-02-01 00:00 UTC")]
    assert report.readme_kinds(data) == ["avx512-bf16"]


def test_levels_are_listed_by_concurrency_whichever_run_each_comes_from():
    older, newer = _dated("2026-12-01 00:00 UTC"), _dated("2026-12-02 00:00 UTC")
    shown = report.by_level([(older, [16, 32]), (newer, [1])])
    assert [level for level, _ in shown] == [1, 16, 32]
    assert shown[0][1] is newer and shown[1][1] is older


def test_an_amd_cpu_is_labelled_with_its_core():
    run = {"cpu": {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "avx512f"]}}
    assert report.cpu_label("avx512-bf16", [run]).startswith("AMD EPYC (Zen 4)")
    run["cpu"]["model"] = "AMD EPYC (Zen 5)"  # a model string that names its core keeps it
    assert report.cpu_label("zen5", [run]).startswith("AMD EPYC (Zen 5),")


def test_every_kind_of_today_with_a_comparable_run_is_shown_once():
    data = {kind: [_dated("2026-12-01 00:00 UTC")] for kind in ("zen5", "xeon-amx", "zen3", "avx2", "other")}
    assert report.readme_kinds(data) == list(report.README_KINDS)
    del data["zen3"]
    assert report.readme_kinds(data) == ["zen5", "xeon-amx", "avx2"]
    data["xeon-amx"] = [{"date": "2026-12-02", "servers": {}}]  # no inferd beside a peer
    assert report.readme_kinds(data) == ["zen5", "avx2"]
    text = report.render_how_fast()
    for kind in report.readme_kinds(report.kinds_of("vs_peers")):
        assert f"`{kind}`" in text


def test_a_run_that_reused_its_prompts_from_the_prefix_cache_shows_its_first_round():
    rounds = [400.0, 520.0, 540.0]
    assert report.cold({"workload": {}}, rounds) == (400.0, True)
    reset = {"workload": {"prefix_cache": report.PREFIX_CACHE_RESET}}
    assert report.cold(reset, rounds) == (520.0, False)
    assert report.cold({"workload": {}}, [400.0]) == (400.0, False)
    assert report.cold({}, []) == (None, False)

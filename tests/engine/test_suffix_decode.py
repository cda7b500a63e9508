"""Suffix decoding: the suffix tree against counting by brute force (growing, evicting), the longest match, the
greedy continuation and its probability, the proposer's budget and its global tree of finished outputs, and
the engine giving exactly the tokens plain decoding gives while a repeated request drafts from an earlier
one's output."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inferd import LLM, SamplingParams
from inferd.config import make_engine_config
from inferd.engine.spec_decode import SuffixProposer, SuffixTree
from inferd.errors import ConfigError
from inferd.request import Request, RequestStatus
from tests.conftest import VOCAB, assert_idle
from tests.engine.echo_model import echo_model
from tests.engine.hf_reference import prompt_set


# -- the tree ----------------------------------------------------------------------------------------
def _brute(seqs, depth: int) -> Counter:
    """Occurrences of every path of 1..depth tokens in the sequences."""
    counts: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def _paths(tree: SuffixTree) -> Counter:
    """Every path the tree holds, with its count: a node's, or 1 along a tail."""
    counts: Counter = Counter()

    def walk(node, path):
        for token, child in node.children.items():
            if isinstance(child, tuple):
                key, pos, end = child
                seq = tree.seqs[key]
                for j in range(pos, min(end, len(seq))):
                    path_j = path + tuple(seq[pos : j + 1])
                    counts[path_j] += 1
            else:
                counts[path + (token,)] += child.count
                walk(child, path + (token,))

    walk(tree.root, ())
    return counts


def _count(tree: SuffixTree, path) -> int:
    place = tree.find(list(path))
    return 0 if place is None else 1 if isinstance(place, tuple) else place.count


def test_the_tree_counts_every_path_up_to_its_depth_as_it_grows_and_as_it_evicts():
    tree = SuffixTree(depth=3)
    tree.extend("a", [1, 2, 1, 2, 3])
    assert [_count(tree, p) for p in [(1,), (2,), (1, 2), (2, 1), (1, 2, 1), (1, 2, 3), (2, 3)]] == [
        2,
        2,
        2,
        1,
        1,
        1,
        1,
    ]
    assert _count(tree, (1, 2, 1, 2)) == 0  # deeper than the tree
    assert tree.root.count == 5
    rng = random.Random(0)
    for _ in range(200):  # small alphabets, so paths repeat, split tails and grow nodes
        depth = rng.randint(1, 6)
        tree = SuffixTree(depth)
        seqs = {k: [rng.randint(0, 2) for _ in range(rng.randint(0, 30))] for k in range(rng.randint(1, 6))}
        for key, seq in seqs.items():  # grown a few tokens at a time, as a request's text is
            tree.extend(key, [])
            while len(tree.seqs[key]) < len(seq):
                have = len(tree.seqs[key])
                tree.extend(key, seq[have : have + rng.randint(1, 3)])
        assert _paths(tree) == _brute(seqs.values(), depth)
        for key in rng.sample(list(seqs), len(seqs)):
            tree.remove(key)
            del seqs[key]
            assert _paths(tree) == _brute(seqs.values(), depth)
        assert not tree.root.children and tree.root.count == 0  # nothing left behind


def test_the_longest_match_is_the_longest_suffix_that_occurs():
    rng = random.Random(1)
    for _ in range(200):
        depth = rng.randint(2, 6)
        tree = SuffixTree(depth)
        for key in range(3):
            tree.add(key, [rng.randint(0, 3) for _ in range(20)])
        paths = set(_brute(tree.seqs.values(), depth))
        context = [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
        want = max((m for m in range(1, min(len(context), depth - 1) + 1) if tuple(context[-m:]) in paths), default=0)
        got = tree.longest_match(context)
        assert (got[0] if got else 0) == want
        if got:
            assert got[1] is not None


def test_the_continuation_follows_the_most_frequent_child_while_its_probability_holds():
    tree = SuffixTree(depth=8)
    outputs = [[5, 6, 7, 8]] * 3 + [[5, 6, 7, 2], [5, 6, 9]]
    for key, out in enumerate(outputs):
        tree.add(key, out)
    place = tree.find([5, 6])  # 5 times: 7 follows 4 of them (0.8), then 8 follows 3 of those 4 (0.8 x 0.75)
    draft, score = tree.continuation(place, budget=8, min_prob=0.5)
    assert draft == [7, 8] and score == pytest.approx(0.8 + 0.6)
    assert tree.continuation(place, budget=8, min_prob=0.7) == ([7], pytest.approx(0.8))
    assert tree.continuation(place, budget=1, min_prob=0.0)[0] == [7]
    assert tree.continuation(place, budget=8, min_prob=0.9) == ([], 0.0)
    tree.remove(0)
    tree.remove(1)  # now 7 follows 2 of 3, and 8 and 2 each follow one of those
    draft, score = tree.continuation(tree.find([5, 6]), budget=8, min_prob=0.0)
    assert draft[0] == 7 and score == pytest.approx(2 / 3 + 1 / 3)


# -- the proposer ------------------------------------------------------------------------------------
def _proposer(**settings) -> SuffixProposer:
    spec = make_engine_config(speculative_method="suffix", **settings).speculative
    return SuffixProposer(spec, max_model_len=1024)


def _decoding(rid: str, prompt: list[int], output: list[int] = (), max_tokens: int = 100) -> Request:
    """A request in the middle of decoding: every token computed but its last."""
    request = Request(rid, rid, 0, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), frozenset())
    request.output_token_ids = list(output)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_the_draft_grows_with_the_match_by_the_spec_factor():
    # the request's own text: (1, 2) occurred before and 3, 1, 2 followed it; the occurrence being written does
    # not count against it (its next token is not known yet), so the draft is as likely as the text is long
    text = [1, 2, 3, 1, 2]
    assert _proposer().propose([_decoding("r", text)]) == {"r": [3, 1]}  # a match of 2: 2 tokens
    assert _proposer(suffix_decoding_max_spec_factor=2.0).propose([_decoding("r", text)]) == {"r": [3, 1, 2]}
    assert _proposer(suffix_decoding_max_spec_factor=0.5).propose([_decoding("r", text)]) == {"r": [3]}
    assert _proposer(suffix_decoding_max_spec_factor=0.0).propose([_decoding("r", text)]) == {}
    long = [4, 5, 6, 7, 8, 9, 10, 11, 4, 5, 6, 7]  # a match of 4; num_speculative_tokens and max_tokens cap it
    assert _proposer().propose([_decoding("r", long)]) == {"r": [8, 9, 10, 11]}
    assert _proposer(num_speculative_tokens=2).propose([_decoding("r", long)]) == {"r": [8, 9]}
    assert _proposer().propose([_decoding("r", long[:8], long[8:], max_tokens=7)]) == {"r": [8, 9]}
    # the tree's depth bounds match and draft together: a shorter match with room for more wins
    assert _proposer(suffix_decoding_max_tree_depth=6).propose([_decoding("r", long)]) == {"r": [8, 9, 10]}


def test_finished_outputs_are_drafted_from_and_the_global_tree_keeps_the_latest():
    proposer = _proposer(suffix_decoding_max_cached_requests=2)
    first = _decoding("a", [300, 301], [10, 11, 12, 13, 14, 15, 16, 17])
    assert proposer.propose([first]) == {} and "a" in proposer.local  # nothing repeats yet
    first.status = RequestStatus.FINISHED_STOPPED
    proposer.finish([first])
    assert "a" not in proposer.local and list(proposer.cache.seqs.values()) == [first.output_token_ids]
    # another request whose output starts as the first one's did: the rest of it, as far as the match allows
    assert proposer.propose([_decoding("b", [400, 401], [10, 11, 12])]) == {"b": [13, 14, 15]}
    aborted = _decoding("c", [402], [50, 51, 52])
    proposer.propose([aborted])
    aborted.status = RequestStatus.FINISHED_ABORTED
    proposer.finish([aborted])
    assert "c" not in proposer.local and len(proposer.cache.seqs) == 1  # an abort's output is not kept
    for i, out in enumerate([[20, 21, 22, 23], [30, 31, 32, 33]]):
        done = _decoding(f"d{i}", [500], out)
        done.status = RequestStatus.FINISHED_LENGTH
        proposer.finish([done])
    assert list(proposer.cache.seqs.values()) == [[20, 21, 22, 23], [30, 31, 32, 33]]  # the oldest went
    assert _paths(proposer.cache) == _brute(proposer.cache.seqs.values(), proposer.depth)
    assert proposer.propose([_decoding("e", [600], [10, 11, 12])]) == {}
    assert proposer.propose([_decoding("f", [600], [30, 31])]) == {"f": [32, 33]}
    assert not _proposer(suffix_decoding_max_cached_requests=0).cache.seqs


def test_the_suffix_config_is_read_as_vllm_spells_it_and_checked():
    spec = make_engine_config(
        speculative_config='{"method": "suffix", "suffix_decoding_max_tree_depth": 16, '
        '"suffix_decoding_max_cached_requests": 50, "suffix_decoding_max_spec_factor": 2.5, '
        '"suffix_decoding_min_token_prob": 0.2}'
    ).speculative
    assert spec.speculative_method == "suffix" and spec.suffix_decoding_max_tree_depth == 16
    assert (spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor) == (50, 2.5)
    assert spec.suffix_decoding_min_token_prob == 0.2
    # num_speculative_tokens left out: vLLM's rule for suffix (the depth), 4 for ngram; given, it is the cap
    assert spec.draft_tokens == 16
    assert make_engine_config(speculative_method="suffix").speculative.draft_tokens == 24
    assert make_engine_config(speculative_method="ngram").speculative.draft_tokens == 4
    assert (
        make_engine_config(
            speculative_config={"method": "suffix", "num_speculative_tokens": 7}
        ).speculative.draft_tokens
        == 7
    )
    for bad, match in [
        ({"method": "suffx"}, "speculative_method must be one of ngram, suffix"),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "suffix_decoding_max_tree_depth must be at least 1",
        ),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be at least 0"),
        ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor must be at least 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob is a probability"),
        ({"suffix_decoding_min_token_prob": "high"}, "suffix_decoding_min_token_prob must be a number"),
        ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth must be an integer"),
        ({"suffix_decoding_max_depth": 8}, "unknown speculative config keys"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_engine_config(speculative_config=bad).validate()


# -- the engine --------------------------------------------------------------------------------------
def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _accepted(llm) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


@pytest.fixture(scope="module")
def random_pair(tiny_models):
    """The tiny random Llama, plain and with suffix decoding (every draft verified: what the tests check does not
    hang on the cost model's timings). Its greedy text rarely repeats itself, so drafts come from the global tree."""
    kw = dict(max_model_len=256, num_blocks=128, dtype="float32")
    plain = LLM(str(tiny_models["llama"]), **kw)
    spec = LLM(str(tiny_models["llama"]), speculative_method="suffix", speculative_draft_policy="all", **kw)
    return plain, spec


def test_a_repeated_request_drafts_its_earlier_output_and_every_token_is_exact(random_pair):
    plain, spec = random_pair
    prompts = prompt_set(VOCAB, lengths=(5, 17, 30), seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [_tokens(plain.generate([p], params)) for p in prompts]
    drafted0, accepted0 = _accepted(spec)
    assert [_tokens(spec.generate([p], params)) for p in prompts] == want  # first pass: nothing cached yet
    drafted1, accepted1 = _accepted(spec)
    assert len(spec.engine.proposer.cache.seqs) == 3 and not spec.engine.proposer.local
    assert [_tokens(spec.generate([p], params)) for p in prompts] == want  # again: the first pass is drafted
    drafted2, accepted2 = _accepted(spec)
    assert accepted2 - accepted1 > 60 and accepted2 - accepted1 > 4 * (accepted1 - accepted0)
    assert accepted2 - accepted1 >= 0.9 * (drafted2 - drafted1)  # the model writes what it wrote before
    # all at once, with eos, stop strings and max_tokens ending them where plain decoding does
    text = plain.generate([prompts[1]], params)[0].outputs[0].text
    mixed = [
        SamplingParams(temperature=0, max_tokens=25),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[10:13]]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    got, ref = spec.generate(prompts, mixed), plain.generate(prompts, mixed)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ref
    ]
    assert got[1].outputs[0].finish_reason == "stop"
    assert_idle(spec)


def test_an_aborted_request_leaves_no_tree_and_no_cached_output(random_pair):
    _, spec = random_pair
    engine = spec.engine
    cached = len(engine.proposer.cache.seqs)
    engine.add_request("gone", prompt_set(VOCAB, lengths=(9,), seed=5)[0], SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    assert "gone" in engine.proposer.local
    engine.abort("gone")
    assert "gone" not in engine.proposer.local and len(engine.proposer.cache.seqs) == cached
    assert_idle(spec)


def test_sampled_requests_take_suffix_drafts(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    spec = LLM(folder, max_model_len=256, num_blocks=128, dtype="float32", speculative_method="suffix")
    prompts = [(p * 4)[:60] for p in prompt_set(VOCAB, lengths=(7, 11, 13))]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    out = _tokens(spec.generate(prompts, params))
    drafted, accepted = _accepted(spec)
    assert all(len(t) == 30 for t in out) and drafted > 0 and accepted > 0
    assert_idle(spec)


def test_no_suffix_drafts_above_the_batch_limit_and_preempted_requests_resume_exactly(tiny_models, tmp_path):
    folder = str(echo_model(tiny_models["llama"], tmp_path / "echo", 0.0))
    kw = dict(max_model_len=128, num_blocks=14, block_size=16, dtype="float32", max_num_seqs=4)
    spec = LLM(folder, speculative_method="suffix", speculative_disable_by_batch_size=4, **kw)
    plain = LLM(folder, **kw)
    prompts = [(p * 4)[:60] for p in prompt_set(VOCAB, lengths=(7, 11, 13))] + [prompt_set(VOCAB, lengths=(40,))[0]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert spec.engine.scheduler.num_preemptions > 0 and _accepted(spec)[1] > 0
    limited = LLM(folder, speculative_method="suffix", speculative_disable_by_batch_size=2, **kw)
    limited.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert _accepted(limited) == (0, 0)  # three running requests, more than 2: no drafts
    assert_idle(spec)
    assert_idle(limited)

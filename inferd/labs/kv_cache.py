"""KV cache: bytes per token from the model's shape and dtype, growth with length x batch, and the
concurrency that fits a memory budget, each checked against the engine's own allocator and tensors."""

from __future__ import annotations

from inferd.engine.kv_cache import KVCacheManager
from inferd.labs.base import Explanation, Lab, Measurement
from inferd.labs.context import LabContext
from inferd.request import Request
from inferd.sampling import SamplingParams

DEFINITION = (
    "cached key/value tensors for every token already processed, so decode doesn't recompute attention over the "
    "whole sequence each step. It grows linearly with sequence length x batch size. It is the dominant consumer "
    "of GPU memory during serving, and therefore the real ceiling on concurrency."
)


def fake_request(i: int, num_tokens: int) -> Request:
    """A request of `num_tokens` prompt tokens, only for the allocator (it never runs)."""
    return Request(f"r{i}", f"r{i}", 0, list(range(num_tokens)), SamplingParams(max_tokens=1), frozenset())


def allocate(kv: KVCacheManager, lengths: list[int]) -> tuple[int, int]:
    """Allocate requests of these lengths in order until one does not fit: (how many fit, blocks used)."""
    fitted = 0
    for i, n in enumerate(lengths):
        if not kv.allocate_slots(fake_request(i, n), n):
            break
        fitted += 1
    return fitted, kv.num_blocks - kv.pool.num_free_blocks


def measure(ctx: LabContext) -> Measurement:
    llm, facts = ctx.llm(), ctx.facts()
    engine = llm.engine
    bs, num_blocks = engine.kv.block_size, engine.kv.num_blocks
    tensor_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    per_block = tensor_bytes // num_blocks
    m = Measurement(settings={"block_size": bs, "num_blocks": num_blocks, "dtype": facts.dtype})
    m.numbers.update(
        layers=facts.num_layers,
        kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        elem_bytes=facts.elem_bytes,
        formula_bytes_per_token=facts.kv_bytes_per_token,
        allocator_bytes_per_token=per_block / bs,
        formula_mismatch=abs(per_block / bs - facts.kv_bytes_per_token),
        cache_mib=tensor_bytes / 2**20,
        weights_mib=facts.weight_bytes / 2**20,
    )
    lengths = ctx.size([128, 256, 512], [512, 1024, 2048])
    batches = [1, 2, 4, 8]
    grid = {}
    for length in lengths:
        for b in batches:
            kv = KVCacheManager(num_blocks, bs, enable_caching=False)
            fitted, used = allocate(kv, [length] * b)
            grid[(length, b)] = used * per_block / 2**20 if fitted == b else None
    L, B = lengths[0], batches[1]
    m.numbers.update(
        L=L, L2=2 * L, B=B, B2=2 * B,
        mib_L_B=grid[(L, B)], mib_2L_B=grid[(2 * L, B)], mib_L_2B=grid[(L, 2 * B)],
    )  # fmt: skip
    m.numbers["twice_mib_L_B"] = 2 * grid[(L, B)]
    fit_len = ctx.max_model_len
    fitted, _ = allocate(KVCacheManager(num_blocks, bs, enable_caching=False), [fit_len] * (num_blocks + 1))
    m.numbers.update(
        fit_len=fit_len,
        fit_measured=fitted,
        fit_predicted=num_blocks * bs // (-(-fit_len // bs) * bs),
        serving_seqs=32,
        serving_kv_mib=32 * fit_len * facts.kv_bytes_per_token / 2**20,
    )
    m.series = {"lengths": lengths, "batches": batches, "mib": [[grid[(n, b)] for b in batches] for n in lengths]}
    return m


def explain(m: Measurement) -> Explanation:
    claims = [
        m.decide(
            "formula_mismatch <= 0",
            must=True,
            yes="The engine's cache tensors hold {allocator_bytes_per_token} bytes per token, exactly the formula "
            "(difference {formula_mismatch}): 2 (K and V) x {layers} layers x {kv_heads} KV heads x {head_dim} dims "
            "x {elem_bytes} bytes = {formula_bytes_per_token}.",
            no="The engine's cache tensors hold {allocator_bytes_per_token} bytes per token, {formula_mismatch} off "
            "the formula's {formula_bytes_per_token}.",
        ),
        m.decide(
            "mib_2L_B <= twice_mib_L_B",
            must=True,
            yes="{B} requests of {L} tokens took {mib_L_B} MiB of blocks; of {L2} tokens {mib_2L_B} MiB "
            "(twice the length, twice the memory: {twice_mib_L_B} MiB).",
            no="{B} requests of {L2} tokens took {mib_2L_B} MiB, more than twice the {mib_L_B} MiB of {L} tokens.",
        ),
        m.decide(
            "mib_L_2B <= twice_mib_L_B",
            must=True,
            yes="{B2} requests of {L} tokens took {mib_L_2B} MiB: twice the batch, twice the memory.",
            no="{B2} requests of {L} tokens took {mib_L_2B} MiB, more than twice {B} requests' {mib_L_B} MiB.",
        ),
        m.decide(
            "fit_measured >= fit_predicted",
            must=True,
            yes="The {cache_mib} MiB cache fits {fit_measured} requests of {fit_len} tokens at once, as predicted "
            "from bytes per token ({fit_predicted}): the cache, not compute, caps concurrency.",
            no="The allocator fitted only {fit_measured} requests of {fit_len} tokens, fewer than the "
            "{fit_predicted} predicted.",
        ),
        m.decide(
            "serving_kv_mib > weights_mib",
            yes="A modest load of {serving_seqs} requests at {fit_len} tokens needs {serving_kv_mib} MiB of KV cache, "
            "more than the model's {weights_mib} MiB of weights: the cache is the dominant consumer of memory.",
            no="{serving_seqs} requests at {fit_len} tokens need {serving_kv_mib} MiB of KV cache, less than the "
            "model's {weights_mib} MiB of weights: for this model and length the weights dominate memory "
            "(grouped-query attention with few KV heads keeps its cache small).",
        ),
    ]
    intro = [
        f"This lab read the model's shape, the engine's cache tensors ({m.settings['num_blocks']} blocks of "
        f"{m.settings['block_size']} tokens, {m.settings['dtype']}), and allocated requests of several lengths and "
        "batch sizes with the engine's own block allocator.",
    ]
    why = [
        "Why it matters: how many requests a replica can serve at once is its cache memory divided by bytes per "
        "token x tokens per request. Fewer KV heads, a smaller KV dtype and paged allocation raise that number; "
        "so does freeing memory that weights would take (quantization)."
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    ax = fig.subplots(1, 1)
    for n, row in zip(m.series["lengths"], m.series["mib"], strict=True):
        xs = [b for b, v in zip(m.series["batches"], row, strict=True) if v is not None]
        ax.plot(xs, [v for v in row if v is not None], "o-", label=f"{n} tokens")
    ax.set(xlabel="batch size (requests)", ylabel="KV cache (MiB, from the allocator)", title="KV cache growth")
    ax.legend()


LAB = Lab("kv-cache", "KV cache", DEFINITION, measure, explain, plot, timed=False)

"""The one measuring library: every number the dashboard, labs, benchmarks, profiler and simulator report
is computed here, so a p99 from any of them is the same number.

Modules, one concept each:

- `stats`: percentiles, by numpy's default linear interpolation (`np.percentile`, as vLLM's serving
  benchmark reports them);
- `arrivals`: when requests arrive: Poisson or gamma processes at a rate, by count or over a duration,
  and a time-varying rate by thinning;
- `hardware`: this machine's ceilings, measured: the matmul peak and the memory read bandwidth (torch);
- `model`: a loaded model's facts: weight bytes a forward pass reads, KV bytes per token, FLOPs per token.

It sits at the bottom of the layers (docs/architecture.md): it imports nothing else of inferd, so the
server and the engine use it as freely as `inferd bench` does. Only `hardware` imports torch.
"""

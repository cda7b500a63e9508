"""Inference-aware autoscaling: signals (queue, KV cache, TTFT/ITL, predicted TTFT) in, replicas out.

`policy.py` is the decision, a pure object fed signal snapshots; the same object runs in `inferd up`'s
loop, in the simulator (`inferd.fleet.sim`) and behind the `inferd_autoscaler_desired_replicas` gauge.
`signals.py` reads the signals from the replicas' `/metrics` or from a Prometheus server.
"""

"""The AI gateway: one OpenAI-compatible address in front of many inferd (or any OpenAI-compatible) replicas.

`inferd gateway --config gateway.yaml` routes by model (aliases, weighted splits, fallbacks), picks a
replica per request through a filter → scorer → picker pipeline (load scraped from the replicas'
`/metrics`, in-flight counts, prefix affinity computed with the engine's own block keys), and admits
tenants against request and token budgets (reserve at admission, settle on the real usage). It imports
only inferd's base layer, never the engine or torch, so it starts in well under a second.
"""
